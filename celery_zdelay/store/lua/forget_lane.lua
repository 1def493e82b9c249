-- Forget a control's held set on one shard once it is empty.
--
-- In one step with the count, so an entry held meanwhile (hold.lua names
-- the set in the lanes set as it fills it) is never left in a set no
-- companion looks at.
--
-- KEYS[1] held zset     id -> due_ms * 1024 + seq
-- KEYS[2] lanes set     names of the controls with a held set on this shard
-- ARGV[1] control name
-- returns 1 when forgotten, 0 when entries are still held
zdelay_expect(KEYS[1], 'zset', KEYS[2], 'set')
if redis.call('ZCARD', KEYS[1]) > 0 then return 0 end
zdelay_t_forget_lane({lanes = KEYS[2]}, ARGV[1])
return 1
