-- Forget entries the broker has accepted, if this claim still owns them.
--
-- An entry is owned while its lease score equals the claim token: a lease
-- that expired and was claimed again, or an id parked again meanwhile, is
-- left alone so its new owner's payload survives.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> due score at claim time
-- KEYS[3] msg hash      id -> payload
-- ARGV[1] claim token (the lease expiry ms the claim returned)
-- ARGV[2..] ids
-- returns the number of entries acknowledged
local lease, leased, msg = KEYS[1], KEYS[2], KEYS[3]
local token = tonumber(ARGV[1])
local acked = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', lease, id)
  if score and tonumber(score) == token then
    redis.call('ZREM', lease, id)
    redis.call('HDEL', leased, id)
    redis.call('HDEL', msg, id)
    acked = acked + 1
  end
end
return acked
