-- Park entries that carry a key or tags: park.lua's work (it runs inside,
-- as zdelay_park()) and the key and tag index in the same step, so any
-- number of producers parking one key leave exactly what its mode says.
-- Entries without either are parked by park.lua alone, at no extra cost.
--
-- An owner held back by a pause or rate limit (hold.lua) is a parked
-- owner like one in the due set: replace and debounce take it out of its
-- held set, keep and until_finished answer it. Where each id is comes from
-- zdelay_where (_where.lua), which needs the names of the shard's held sets
-- to move one: the caller passes those it knows, and is told to read them
-- again (-2) when an id it must move is in a set it did not name. A held
-- entry parked again under its own id leaves its held set in park.lua,
-- which is given the same held sets (found here first, so that park.lua,
-- run after this script's writes, never has to answer -2).
--
-- A debounce's record carries its burst (see the burst below and
-- _marks.lua): an entry whose max_wait caps it is parked due at the cap,
-- however it asked (countdown, eta, jitter).
--
-- KEYS[1..10] as park.lua (KEYS[6] the call marker, KEYS[8] the lanes set,
--            KEYS[9] the marks hash, KEYS[10] the tagged zset: see
--            _marks.lua), with no held set among them
-- KEYS[11..] other shards' keys to check, as park.lua
-- then       held zsets   one per control name of ARGV (see below), in that order
-- ARGV as park.lua with no held set (ARGV[4] 0), then one mark record per
--      entry (see _marks.lua), then the control names of the held zsets,
--      then their number, then the number of entries
-- returns three per entry, in argument order: the id of the entry parked
--         for it afterwards (its own, or for a key the entry holding it),
--         that entry's due ms (-1 when it is no longer parked: released
--         and running), 1 when this call parked it, else 0; then, after
--         those, one per entry in argument order: the id of the parked
--         entry its replace or debounce took out (so the caller reports it
--         cancelled), or '' for none;
--         or {-2}, having written nothing, when an entry to move or answer
--         is held in a set not given (read the lanes set and call again)
if redis.replicate_commands then redis.replicate_commands() end

local marks, tagged = KEYS[9], KEYS[10]
local n = tonumber(table.remove(ARGV))
if not n then error({err = 'ERR celery-zdelay park_keyed: no entry count'}) end
local n_lanes = tonumber(table.remove(ARGV))
if not n_lanes then error({err = 'ERR celery-zdelay park_keyed: no held set count'}) end
local lane_names, kheld = {}, {}
for i = n_lanes, 1, -1 do
  lane_names[i] = table.remove(ARGV)
  kheld[i] = table.remove(KEYS)
end
local klanes = KEYS[8]
local records = {}
for e = n, 1, -1 do records[e] = table.remove(ARGV) end

local kdue, kmsg, kmarker, ktemplates = KEYS[1], KEYS[2], KEYS[6], KEYS[7]
-- A retried call (its reply was lost) answers what the first one did.
local kdone = redis.call('GET', kmarker)
if kdone then return cjson.decode(kdone) end

zdelay_expect_park()  -- marks, tagged and the lanes set among them
for _, key in ipairs(kheld) do zdelay_expect(key, 'zset') end
local klayout = zdelay_park_layout()
local kfirst_template, kfirst = klayout.first_template, klayout.first_entry
if #ARGV - kfirst + 1 ~= 5 * n then
  error({err = 'ERR celery-zdelay park_keyed: ' .. n .. ' mark records for the entries given'})
end
local know = zdelay_now_ms()

-- Where a parked id is (_where.lua): state, the set that has it, its due
-- score. An id held in a set not given is found again once the caller has
-- read the lanes (lanes_stale); a payload no set has, with every set given,
-- is a stray nothing releases: not parked.
local kplace = {due = kdue, lease = KEYS[3], msg = kmsg, held = kheld}
local lanes_stale, lanes_complete = false, nil
local function placed(id)
  local state, from, score = zdelay_where(kplace, id)
  if state == 'held' and not from then
    if lanes_complete == nil then lanes_complete = zdelay_lanes_given(klanes, lane_names) end
    if not lanes_complete then lanes_stale = true end
    return nil
  end
  return state, from, score
end

-- Who owns each key as the batch goes: {id, until ms or nil, index of an
-- entry of this batch or nil, where a parked owner is: state, set, due
-- score}, false when free. A key whose run ended is free.
local owners = {}
local function owner_of(key)
  local h = owners[key]
  if h == nil then
    local id, until_ms = zdelay_mark_owner(redis.call('HGET', marks, 'k:' .. key))
    if id and until_ms and until_ms <= know then id = nil end
    h = id and {id, until_ms} or false
    if h and until_ms == nil then h[4], h[5], h[6] = placed(id) end
    owners[key] = h
  end
  return h
end

-- A debounce's burst: the calls of a key from the one that found it free
-- (or held by a task no longer waiting: released, running) to its run.
-- Its first call's time ("f", Redis clock) and its max_wait ("w", the
-- smallest any of its calls gave: a cap only tightens) pass from the
-- parked owner a debounce takes out (or the earlier entry of this batch
-- it replaces) to the new entry's record; the entry is due at the sooner
-- of what it asked for (countdown, eta, jitter included) and f + w. A
-- owner whose record has no "f" (another mode, or written before
-- max_wait existed) starts a burst now.
local bursts, capped = {}, {}
local function debounce(e, h, fields)
  local first, cap
  if h and h[3] then
    local b = bursts[h[3]]
    if b then first, cap = b[1], b[2] end
  elseif h and (h[4] == 'due' or h[4] == 'held') then
    -- Still waiting (a running hold or a task being released has no such place).
    local held = redis.call('HGET', marks, 'i:' .. h[1])
    local _, _, _, _, was = zdelay_mark_parse(held or '')
    if was.f then first, cap = was.f, was.w end
  end
  first = first or know
  if fields.w and (not cap or fields.w < cap) then cap = fields.w end
  bursts[e] = {first, cap}
  records[e] = zdelay_mark_with(records[e], {'f', 'w'}, {f = first, w = cap})
  if cap then
    local base = kfirst + 5 * (e - 1)
    local ms = tonumber(ARGV[base + 2])
    if not ms then error({err = 'ERR celery-zdelay park_keyed: entry ' .. e .. ' has no due ms'}) end
    local wanted = ARGV[base + 1] == 'r' and know + ms or ms
    if first + cap < wanted then capped[e] = first + cap end
  end
end

local parks, keyof, tagsof, replaced, took_out = {}, {}, {}, {}, {}
local forget, forgotten, unheld = {}, {}, {}
for e = 1, n do
  local id = ARGV[kfirst + 5 * (e - 1)]
  local mode, _, key, tags, fields = zdelay_mark_parse(records[e])
  keyof[e], tagsof[e] = key, tags
  parks[e] = true
  if key ~= '' then
    local h = owner_of(key)
    if mode == 'd' then debounce(e, h, fields) end
    if h and h[2] ~= nil and h[1] == id then
      -- Its own task, running, parks itself again (Celery's retry under
      -- the same id): it is parked, and owns the key as parked.
      parks[e] = true
    elseif h and (mode == 'k' or mode == 'u') then
      parks[e] = false
    elseif h then
      if h[3] then
        parks[h[3]] = false  -- an earlier entry of this batch: never parked
      elseif h[2] == nil and h[1] ~= id and (h[4] == 'due' or h[4] == 'held') then
        -- The parked owner goes, waiting or held back; one being released
        -- cannot be stopped.
        replaced[#replaced + 1] = {h[1], h[5]}
        took_out[e] = h[1]
      end
    end
    if parks[e] then owners[key] = {id, nil, e} end
  end
  if parks[e] and not unheld[id] and redis.call('HEXISTS', kmsg, id) == 1 then
    -- Parked again under its id while held: it leaves its held set in
    -- park.lua (never two places). Looked for here, before any write, so
    -- that a held set not given is answered with -2 now.
    local state, from = placed(id)
    if state == 'held' then unheld[id] = from end
  end
  if parks[e] and not forgotten[id] and redis.call('HEXISTS', marks, 'i:' .. id) == 1 then
    -- Parked again under its id: its earlier key and tags give way.
    forgotten[id] = true
    forget[#forget + 1] = id
  end
end
if lanes_stale then return {-2} end
for _, item in ipairs(replaced) do
  local id = item[1]
  if not forgotten[id] then forgotten[id] = true; forget[#forget + 1] = id end
end

-- Reads for the writes below, all before the first of them.
local kplan = zdelay_marks_plan(marks, tagged, forget, 'cancel', know)
local kreleased = {}
for _, item in ipairs(replaced) do
  zdelay_count(kreleased, zdelay_template_id(redis.call('HGET', kmsg, item[1])), -1)
end
local krefs = zdelay_refs_plan(ktemplates, kreleased)
local used = {}
for e = 1, n do
  if parks[e] then
    local tid = zdelay_template_id(ARGV[kfirst + 5 * (e - 1) + 3])
    if tid then used[tid] = true end
  end
end

-- Writes: the replaced entries leave (from the due set or a held set) and
-- the marks of ids parked again with them, the others are parked, then indexed.
local kshard = {due = kdue, msg = kmsg, templates = ktemplates, marks = marks, tagged = tagged}
zdelay_t_cancel(kshard, replaced, krefs, kplan)

-- ARGV is Redis's table (the global cannot be reassigned): park.lua reads
-- it, so it holds the entries to park while zdelay_park() runs.
local all_args = {}
for i = 1, #ARGV do all_args[i] = ARGV[i] end
-- The held sets go to park.lua in its own places (KEYS[11..], ARGV[5..]).
local kept = {all_args[1], all_args[2], 0, n_lanes}
for i = 1, n_lanes do kept[#kept + 1] = lane_names[i] end
for i = kfirst_template, kfirst - 1, 2 do
  if used[all_args[i]] then
    kept[#kept + 1] = all_args[i]
    kept[#kept + 1] = all_args[i + 1]
    kept[3] = kept[3] + 1
  end
end
local order = {}
for e = 1, n do
  if parks[e] then
    order[#order + 1] = e
    local base = kfirst + 5 * (e - 1)
    for f = 0, 4 do kept[#kept + 1] = all_args[base + f] end
    if capped[e] then
      -- max_wait caps it: due at the burst's first call + max_wait.
      kept[#kept - 3], kept[#kept - 2] = 'a', string.format('%.0f', capped[e])
    end
  end
end
local due_of = {}
if #order > 0 then
  for i = #ARGV, 1, -1 do ARGV[i] = nil end
  for i = 1, #kept do ARGV[i] = kept[i] end
  for i, key in ipairs(kheld) do table.insert(KEYS, 10 + i, key) end
  local parked_ms = zdelay_park()
  for j, e in ipairs(order) do due_of[e] = parked_ms[j] end
end

for _, e in ipairs(order) do
  local id, key = all_args[kfirst + 5 * (e - 1)], keyof[e]
  local record = (key ~= '' or #tagsof[e] > 0) and records[e]
  if key ~= '' and owners[key][3] ~= e then key = '' end
  zdelay_t_index(kshard, id, record, key, tagsof[e], false)
end

local result = {}
for e = 1, n do
  local id, ms, flag = all_args[kfirst + 5 * (e - 1)], -1, 0
  if parks[e] then
    ms, flag = due_of[e], 1
  end
  local key = keyof[e]
  local h = key ~= '' and owners[key]
  -- Kept for an owner (another entry, or this id already parked under the
  -- key): answer the owner and its due ms.
  if h and (h[1] ~= id or not parks[e]) then
    id = h[1]
    if h[3] then
      ms = due_of[h[3]]
    elseif h[6] then
      -- Waiting or held back: its due ms (one being released has none).
      ms = math.floor(tonumber(h[6]) / 1024)
    end
    flag = 0
  end
  result[#result + 1] = id
  result[#result + 1] = ms
  result[#result + 1] = flag
end
for e = 1, n do result[#result + 1] = took_out[e] or '' end
redis.call('SET', kmarker, cjson.encode(result), 'PX', all_args[2])
return result
