-- Record occurrences a companion parked for one schedule.
--
-- KEYS[1] pointers hash    name -> {"v", "ms", "ids"} (see define.lua)
-- KEYS[2] paused set
-- ARGV[1] name
-- ARGV[2] version the occurrences were planned from
-- ARGV[3] new pointer ms (the newest occurrence planned)
-- ARGV[4] ids of occurrences before this ms are forgotten
-- ARGV[5..] pairs: occurrence ms, id parked (the record's "n" counts those
--           not listed yet: the occurrences parked under this version)
-- returns 1; 0 when the schedule was paused since it was read (the caller
--         cancels what it parked); -1 when the definition changed or went
--         away (the caller cancels what it parked ahead: see define.lua)
local pointers, paused = KEYS[1], KEYS[2]
local name = ARGV[1]
zdelay_expect(pointers, 'hash', paused, 'set')
local record = redis.call('HGET', pointers, name)
if not record then return -1 end
local r = cjson.decode(record)
if redis.call('SISMEMBER', paused, name) == 1 then return 0 end
if tostring(r.v) ~= ARGV[2] then return -1 end
local new_ms = tonumber(ARGV[3])
if new_ms > r.ms then r.ms = new_ms end
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
for i = 5, #ARGV, 2 do
  local id = ARGV[i + 1]
  if not seen[id] then
    ids[#ids + 1] = {tonumber(ARGV[i]), id}
    seen[id] = true
    added = added + 1
  end
end
r.ids = ids
r.n = (tonumber(r.n) or 0) + added
redis.call('HSET', pointers, name, cjson.encode(r))
return 1
