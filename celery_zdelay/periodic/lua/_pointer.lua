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
