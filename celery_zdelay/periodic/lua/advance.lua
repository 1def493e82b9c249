-- Record occurrences a companion parked for one schedule.
--
-- KEYS[1] pointers hash    name -> {"v", "ms", "ids"} (see define.lua)
-- KEYS[2] paused set
-- KEYS[3] counts hash     "<name>\n<counter>" -> ticks (see PeriodicStore.count)
-- KEYS[4] missed zset     this schedule's occurrence ids left out -> their ms
--                         (what "periodic backfill" runs)
-- KEYS[5] runs hash       name -> last occurrence released (see record_runs.lua)
-- KEYS[6] visits zset     name -> ms a planner pass looks at it from (see _pointer.lua)
-- ARGV[1] name
-- ARGV[2] version the occurrences were planned from
-- ARGV[3] new pointer ms (the newest occurrence planned)
-- ARGV[4] ids of occurrences before this ms are forgotten
-- ARGV[5] occurrences the missed policy left out on the way to the new
--         pointer: counted as missed once, by whoever moves the pointer
-- ARGV[6] how many pairs of those (ms, id) follow, recorded in KEYS[4]
-- ARGV[7..] those pairs, then the pairs: occurrence ms, id parked (the record's "n" counts those
--           not listed yet: the occurrences parked under this version)
-- returns 1; 0 when the schedule was paused since it was read (the caller
--         cancels what it parked); -1 when the definition changed or went
--         away (the caller cancels what it parked ahead: see define.lua)
local pointers, paused, counts, missed_ids, runs, visits =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local name = ARGV[1]
zdelay_expect(pointers, 'hash', paused, 'set', counts, 'hash', missed_ids, 'zset',
  runs, 'hash', visits, 'zset')
-- Most missed occurrences remembered per schedule (the newest).
local KEEP_MISSED = 1000
local listed_missed = tonumber(ARGV[6]) or 0
local first_pair = 7 + 2 * listed_missed
local record = redis.call('HGET', pointers, name)
if not record then return -1 end
local r = cjson.decode(record)
if redis.call('SISMEMBER', paused, name) == 1 then return 0 end
if tostring(r.v) ~= ARGV[2] then return -1 end
local new_ms = tonumber(ARGV[3])
local missed = tonumber(ARGV[5]) or 0
if new_ms > r.ms then
  r.ms = new_ms
  if missed > 0 then redis.call('HINCRBY', counts, name .. '\nmissed', missed) end
  for i = 7, first_pair - 1, 2 do
    redis.call('ZADD', missed_ids, tonumber(ARGV[i]), ARGV[i + 1])
  end
  if listed_missed > 0 then
    redis.call('ZREMRANGEBYRANK', missed_ids, 0, -KEEP_MISSED - 1)
  end
end
-- A tick taken over from the previous version (define.lua) is planned now.
if new_ms >= r.ms then r.incl = nil end
local keep_after = tonumber(ARGV[4])
local ids, seen = {}, {}
if type(r.ids) == 'table' then
  for _, pair in ipairs(r.ids) do
    if pair[1] >= keep_after and not seen[pair[2]] then
      ids[#ids + 1] = pair
      seen[pair[2]] = true
    end
  end
end
-- Each occurrence counts once however many companions record it: those
-- already listed were counted by whoever listed them (zdelay_max_runs).
local added = 0
for i = first_pair, #ARGV, 2 do
  local id = ARGV[i + 1]
  if not seen[id] then
    ids[#ids + 1] = {tonumber(ARGV[i]), id}
    seen[id] = true
    added = added + 1
  end
end
r.ids = ids
r.n = (tonumber(r.n) or 0) + added
-- Planned now: a visit put off (defer.lua) is over.
r.wake, r.next = nil, nil
redis.call('HSET', pointers, name, cjson.encode(r))
redis.call('ZADD', visits, periodic_next_visit(r, runs, name), name)
return 1
