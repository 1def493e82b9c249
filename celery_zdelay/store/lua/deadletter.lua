-- Move claimed entries that cannot be published to the dead-letter set,
-- keeping their payload and the reason, so one bad entry never holds up the
-- entries behind it.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> due score at claim time
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] dead zset     id -> dead-lettered at ms
-- KEYS[5] dead hash     id -> reason JSON "\n" payload
-- ARGV[1] claim token
-- ARGV[2..] pairs: id, reason JSON (one line)
-- returns the number of entries dead-lettered
if redis.replicate_commands then redis.replicate_commands() end
local lease, leased, msg, dead, dead_msg = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token = tonumber(ARGV[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local moved = 0
for i = 2, #ARGV, 2 do
  local id, reason = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', lease, id)
  if score and tonumber(score) == token then
    local payload = redis.call('HGET', msg, id) or ''
    redis.call('HSET', dead_msg, id, reason .. '\n' .. payload)
    redis.call('ZADD', dead, now_ms, id)
    redis.call('ZREM', lease, id)
    redis.call('HDEL', leased, id)
    redis.call('HDEL', msg, id)
    moved = moved + 1
  end
end
return moved
