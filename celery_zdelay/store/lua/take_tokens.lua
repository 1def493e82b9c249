-- Take tokens from the bucket of one release rate limit, or give unused ones back.
--
-- The bucket is the only key this touches, and has a hash tag of its own:
-- on a Redis Cluster it sits on one node, whatever node the shards are on.
-- A companion takes tokens here before it claims held entries (another
-- script, maybe on another node) and gives back what it did not use; one
-- that dies in between has spent its tokens on nothing. Those are not
-- leaked for ever: the bucket refills with time whatever was taken, so the
-- limit is only under-used for a moment, and never exceeded.
--
-- KEYS[1] bucket hash   level -> tokens in the bucket at ms; ms -> Redis ms
-- ARGV[1] tokens added per ms (the limit's rate)
-- ARGV[2] burst: most tokens the bucket holds
-- ARGV[3] tokens wanted (0 when only giving back)
-- ARGV[4] unused tokens given back first (0 when only taking)
-- returns {tokens granted, ms until the next whole token (0 when all were granted)}
if redis.replicate_commands then redis.replicate_commands() end

local bucket = KEYS[1]
local per_ms, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local wanted, returned = tonumber(ARGV[3]), tonumber(ARGV[4])
zdelay_expect(bucket, 'hash')
local now_ms = zdelay_now_ms()
local stored = redis.call('HMGET', bucket, 'level', 'ms')
local level, since = tonumber(stored[1]), tonumber(stored[2])
if not level or not since then
  -- A new (or expired) bucket is full: nothing was released for a while.
  level, since = burst, now_ms
end
-- Time only adds tokens: a bucket written ahead of this clock (a failover to
-- a node whose clock is behind) gains none until the clock passes it, and
-- never more than the burst, however long it was left.
level = math.min(burst, level + math.max(0, now_ms - since) * per_ms + returned)

local granted = math.min(wanted, math.floor(level))
level = level - granted
local wait_ms = 0
if granted < wanted then wait_ms = math.max(1, math.ceil((1 - level) / per_ms)) end
redis.call('HSET', bucket, 'level', tostring(level), 'ms', tostring(now_ms))
-- A bucket left alone refills to full; past that time it need not exist.
redis.call('PEXPIRE', bucket, math.ceil(burst / per_ms) + 60000)
return {granted, wait_ms}
