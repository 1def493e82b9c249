-- Record the last occurrence released of schedules, only when newer than the one recorded.
--
-- KEYS[1] runs hash   name -> JSON {"ms": occurrence ms, "lateness_ms", "id", "by"}
-- ARGV    pairs: name, that JSON
-- returns the names recorded now: a run recorded already (by the companion
--         that released it, or by the one that parked it and found it
--         released, see PeriodicServer._settle_parked) is recorded once
if redis.replicate_commands then redis.replicate_commands() end

local runs = KEYS[1]
zdelay_expect(runs, 'hash')
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
  end
end
return recorded
