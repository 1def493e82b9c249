-- Move every parked entry of a shard earlier: time passes for what is parked.
--
-- Only celery_zdelay.testing runs this, to fast-forward a test's clock. The
-- score keeps its same-millisecond sequence (the low 10 bits), so the order
-- of entries is unchanged; entries in flight are not touched.
--
-- KEYS[1] due zset   id -> due_ms * 1024 + seq
-- ARGV[1] ms to move every entry earlier (a positive integer)
-- returns the number of entries moved
local due = KEYS[1]
local delta = tonumber(ARGV[1]) * 1024
local entries = redis.call('ZRANGE', due, 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  redis.call('ZADD', due, tonumber(entries[i + 1]) - delta, entries[i])
end
return #entries / 2
