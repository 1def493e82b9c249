-- Acquire, renew or give up the ownership lease of one shard, so companions
-- sharing many shards each claim from their own (no blind contention).
--
-- KEYS[1] owner string  companion id, expiring with the lease
-- ARGV[1] companion id
-- ARGV[2] "acquire" (only if unowned), "renew" (only if ours) or "release"
-- ARGV[3] lease length ms
-- returns 1 when the companion owns the shard after the call, else 0
local owner, me, action, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local current = redis.call('GET', owner)
if action == 'release' then
  if current == me then redis.call('DEL', owner) end
  return 0
end
if current == me or (action == 'acquire' and not current) then
  redis.call('SET', owner, me, 'PX', ttl)
  return 1
end
return 0
