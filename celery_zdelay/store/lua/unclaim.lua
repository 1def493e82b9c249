-- Give claimed entries back, due again at their original time, because the
-- broker did not accept them. Only entries this claim still owns move.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> due score at claim time
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- ARGV[1] claim token
-- ARGV[2..] ids
-- returns the number of entries given back
local lease, leased, due = KEYS[1], KEYS[2], KEYS[3]
local token = tonumber(ARGV[1])
local moved = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', lease, id)
  if score and tonumber(score) == token then
    local due_score = redis.call('HGET', leased, id)
    redis.call('ZADD', due, due_score or 0, id)
    redis.call('ZREM', lease, id)
    redis.call('HDEL', leased, id)
    moved = moved + 1
  end
end
return moved
