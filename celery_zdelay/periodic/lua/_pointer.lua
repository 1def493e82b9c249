-- Loaded in front of define.lua and pause.lua (after the store's
-- _guard.lua): reading a schedule's pointer, which never raises, so a
-- corrupt pointer cannot stop a script halfway.

-- The pointer record of schedule *name* (see define.lua) as a table, or nil
-- when there is none or it cannot be read.
local function periodic_pointer(pointers, name)
  local record = redis.call('HGET', pointers, name)
  if not record then return nil end
  local ok, r = pcall(cjson.decode, record)
  if ok and type(r) == 'table' then return r end
  return nil
end

-- The occurrences pointer *r* lists as parked, split at *now_ms*: those
-- still ahead, and those due by then (pairs {ms, id}; an id that is not a
-- string is left out: no Redis command could take it).
local function periodic_parked(r, now_ms)
  local ahead, due = {}, {}
  if not r or type(r.ids) ~= 'table' then return ahead, due end
  for _, pair in ipairs(r.ids) do
    if type(pair) == 'table' and type(pair[2]) == 'string' then
      if type(pair[1]) == 'number' and pair[1] <= now_ms then
        due[#due + 1] = pair
      else
        ahead[#ahead + 1] = pair
      end
    end
  end
  return ahead, due
end

-- The ms from which a planner pass looks at schedule *name* (its score in
-- the visits zset, see PeriodicKeys.visits): its pointer's ms (where the
-- next occurrences are planned from), or the earliest occurrence the
-- pointer lists as parked that no companion recorded as run (in the runs
-- hash; none given: none recorded), if earlier, so companions look at it
-- until its run is recorded.
-- When the pointer lists no such occurrence and a planner put its next
-- one off (its "wake", written by defer.lua: parked within the hour before
-- it is due), that time instead, if later.
-- A pointer that cannot be read is never looked at ('+inf'), as a pass
-- leaves it out. Must equal next_visit_ms() in periodic/store.py.
local function periodic_next_visit(r, runs, name)
  local at = r and tonumber(r.ms)
  if not at then return '+inf' end
  local last = -1
  if runs then
    local ok, run = pcall(cjson.decode, redis.call('HGET', runs, name) or '')
    if ok and type(run) == 'table' and tonumber(run.ms) then last = tonumber(run.ms) end
  end
  local waiting = false
  if type(r.ids) == 'table' then
    for _, pair in ipairs(r.ids) do
      if type(pair) == 'table' and type(pair[1]) == 'number' and pair[1] > last then
        waiting = true
        if pair[1] < at then at = pair[1] end
      end
    end
  end
  if not waiting and type(r.wake) == 'number' and r.wake > at then at = r.wake end
  -- As an integer: a Lua number would be written as 1.7649720000001e+12.
  return string.format('%d', at)
end
