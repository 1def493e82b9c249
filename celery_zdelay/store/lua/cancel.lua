-- Cancel parked entries that have not been claimed for release yet.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- ARGV[1..] ids
-- returns one flag per id: 1 cancelled, 0 not parked (unknown, or released)
local due, msg = KEYS[1], KEYS[2]
zdelay_expect(due, 'zset', msg, 'hash')
local result = {}
for i = 1, #ARGV do
  local removed = redis.call('ZREM', due, ARGV[i])
  if removed == 1 then redis.call('HDEL', msg, ARGV[i]) end
  result[i] = removed
end
return result
