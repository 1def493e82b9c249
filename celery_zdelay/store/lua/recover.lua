-- Return entries whose lease expired (their companion died or stalled) to
-- the due set at their original due time, so they are released again.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> due score at claim time
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- ARGV[1] most entries to recover
-- returns the number of entries recovered
if redis.replicate_commands then redis.replicate_commands() end
local lease, leased, due = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(expired) do
  local due_score = redis.call('HGET', leased, id)
  redis.call('ZADD', due, due_score or now_ms * 1024, id)
  redis.call('HDEL', leased, id)
end
if #expired > 0 then
  redis.call('ZREMRANGEBYRANK', lease, 0, #expired - 1)
end
return #expired
