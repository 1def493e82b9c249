-- Delete the history records that expired (see _history.lua), a bounded
-- number per call, so a companion's sweep never blocks Redis for long.
-- Reads already ignore an expired record: this only frees its memory.
--
-- KEYS[1] history hash      id -> event lines
-- KEYS[2] history_exp zset  id -> ms its record expires
-- ARGV[1] most records to delete
-- returns the number of records deleted
if redis.replicate_commands then redis.replicate_commands() end
local hist, exp = KEYS[1], KEYS[2]
zdelay_expect(hist, 'hash', exp, 'zset')
local ids = redis.call('ZRANGEBYSCORE', exp, '-inf', zdelay_now_ms(), 'LIMIT', 0, tonumber(ARGV[1]))
if #ids == 0 then return 0 end
redis.call('HDEL', hist, unpack(ids))
redis.call('ZREM', exp, unpack(ids))
return #ids
