-- Record the last occurrence released of schedules, only when newer than the one recorded.
--
-- KEYS[1] runs hash   name -> JSON {"ms": occurrence ms, "lateness_ms", "id", "by"}
-- KEYS[2] pointers hash, KEYS[3] visits zset (see _pointer.lua): a schedule
--         whose run is recorded is looked at from its next occurrence on
-- ARGV    pairs: name, that JSON
-- returns the names recorded now: a run recorded already (by the companion
--         that released it, or by the one that parked it and found it
--         released, see PeriodicServer._settle_parked) is recorded once
if redis.replicate_commands then redis.replicate_commands() end

local runs, pointers, visits = KEYS[1], KEYS[2], KEYS[3]
zdelay_expect(runs, 'hash', pointers, 'hash', visits, 'zset')
local recorded = {}
for i = 1, #ARGV, 2 do
  local name, record = ARGV[i], ARGV[i + 1]
  local stored = redis.call('HGET', runs, name)
  local ok, old = pcall(cjson.decode, stored or '')
  local new = cjson.decode(record)
  if not stored or not ok or type(old) ~= 'table' or tonumber(old.ms) == nil
      or tonumber(old.ms) < tonumber(new.ms) then
    redis.call('HSET', runs, name, record)
    recorded[#recorded + 1] = name
    -- Only a schedule looked at already: not one paused or removed.
    if redis.call('ZSCORE', visits, name) then
      redis.call('ZADD', visits, periodic_next_visit(periodic_pointer(pointers, name), runs, name),
        name)
    end
  end
end
return recorded
