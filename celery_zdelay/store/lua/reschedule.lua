-- Move a parked entry to a new due time. Entries already claimed for
-- release are not moved.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- ARGV[1] wake channel, published to when the earliest due time moves earlier
--         (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2] id
-- ARGV[3] mode: "r" due ms after the Redis clock, "a" absolute epoch ms
-- ARGV[4] ms
-- returns the new due ms, or -1 when the id is not parked
if redis.replicate_commands then redis.replicate_commands() end
local due = KEYS[1]
local id, mode, ms = ARGV[2], ARGV[3], zdelay_number(ARGV[4])
zdelay_expect(due, 'zset')
if not ms then error({err = 'ERR celery-zdelay reschedule: the due time is not a number'}) end
if not redis.call('ZSCORE', due, id) then return -1 end
local now_ms = zdelay_now_ms()
local due_ms = ms
if mode == 'r' then due_ms = now_ms + ms end

local head = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
local before = tonumber(head[2])
redis.call('ZREM', due, id)
-- Take the next sequence slot of the new millisecond, as park.lua does.
local lo = due_ms * 1024
local top = redis.call('ZREVRANGEBYSCORE', due, lo + 1023, lo, 'WITHSCORES', 'LIMIT', 0, 1)
local score = lo
if top[2] then score = math.min(tonumber(top[2]) + 1, lo + 1023) end
redis.call('ZADD', due, score, id)
if score < before then
  zdelay_wake(ARGV[1], due_ms)
end
return due_ms
