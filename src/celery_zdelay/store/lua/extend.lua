-- Extend the lease of claimed entries that are still being published (the
-- broker is slow or down), so no other companion releases them meanwhile.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- ARGV[1] current claim token
-- ARGV[2] lease length ms from now
-- ARGV[3..] ids
-- returns {new claim token, number of entries extended}
if redis.replicate_commands then redis.replicate_commands() end
local lease = KEYS[1]
local token, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new_token = now_ms + lease_ms
-- Tokens only grow, so a stale owner can never collide with a new claim.
if new_token <= token then new_token = token + 1 end
local extended = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', lease, id)
  if score and tonumber(score) == token then
    redis.call('ZADD', lease, new_token, id)
    extended = extended + 1
  end
end
return {new_token, extended}
