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
if redis.call('HEXISTS', defs, name) == 0 then return 0 end
local record = redis.call('HGET', pointers, name)
local r = record and cjson.decode(record) or nil
if ARGV[1] == 'pause' then
  if redis.call('SADD', paused, name) == 0 then return 2 end
  -- What was parked ahead would still run: cancel it.
  if r and type(r.ids) == 'table' then
    for _, pair in ipairs(r.ids) do redis.call('SADD', cancel, pair[2]) end
  end
  return 1
end
if redis.call('SREM', paused, name) == 0 then return 2 end
-- Resumed from now: occurrences while paused do not count as missed.
-- A new version gives the occurrences new ids: those cancelled by the pause
-- are remembered as parked (park_once), so under the old ids a calendar
-- schedule's next tick would never be parked again.
if r then
  r.v = redis.call('HINCRBY', versions, name, 1)
  local t = redis.call('TIME')
  r.ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  r.ids = {}
  redis.call('HSET', pointers, name, cjson.encode(r))
end
return 1
