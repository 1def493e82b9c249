-- Pause or resume one schedule.
--
-- KEYS[1] defs hash
-- KEYS[2] pointers hash    (see define.lua)
-- KEYS[3] paused set
-- KEYS[4] cancel set
-- KEYS[5] versions hash    (see define.lua)
-- ARGV[1] "pause" or "resume"
-- ARGV[2] name
-- returns 1 done, 0 no such schedule, 2 already so
if redis.replicate_commands then redis.replicate_commands() end

local defs, pointers, paused, cancel, versions = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local name = ARGV[2]
-- Everything that can fail is checked before the first write.
zdelay_expect(defs, 'hash', pointers, 'hash', paused, 'set', cancel, 'set', versions, 'hash')
if redis.call('HEXISTS', defs, name) == 0 then return 0 end
local r = periodic_pointer(pointers, name)
if ARGV[1] == 'pause' then
  if redis.call('SISMEMBER', paused, name) == 1 then return 2 end
  redis.call('SADD', paused, name)
  -- What was parked would still run, even what is due already: cancel it.
  local ahead, due = periodic_parked(r, 0)
  for _, pair in ipairs(ahead) do redis.call('SADD', cancel, pair[2]) end
  for _, pair in ipairs(due) do redis.call('SADD', cancel, pair[2]) end
  return 1
end
if redis.call('SISMEMBER', paused, name) == 0 then return 2 end
zdelay_expect_field_counter(versions, name)
redis.call('SREM', paused, name)
-- Resumed from now: occurrences while paused do not count as missed.
-- A new version gives the occurrences new ids: those cancelled by the pause
-- are remembered as parked (park_once), so under the old ids a calendar
-- schedule's next tick would never be parked again.
-- (A pointer that could not be read is written afresh.)
r = r or {}
r.v = redis.call('HINCRBY', versions, name, 1)
r.ms = zdelay_now_ms()
r.ids = {}
redis.call('HSET', pointers, name, cjson.encode(r))
return 1
