-- Take one message of celery-redis-plus out of the broker's Redis, for zdelay
-- adopt, after its copy is parked: only while no consumer holds it.
--
-- KEYS[1] messages_index:<queue> zset  delivery tag -> epoch s it is looked at next
-- KEYS[2] queue:<queue> zset           delivery tag -> what consumers pop next
-- KEYS[3] message:<delivery tag> hash  payload, routing_key, native_delayed, eta...
-- ARGV[1] the delivery tag
-- returns 1 when the message was waiting (delayed in the index, or in the
--         queue with no consumer having popped it) and is now gone from
--         celery-redis-plus, 0 when a consumer took it or it was gone already
--         (then nothing is changed: that consumer runs it)
--
-- celery-redis-plus's consumers pop a message from the queue set in one
-- script, and a delayed message reaches that set only by its workers' sweep,
-- which clears native_delayed in the same step: in this one step, a message
-- either is still waiting and leaves, or a consumer has it and stays.
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local waiting = redis.call('ZREM', KEYS[2], ARGV[1]) == 1
if not waiting and redis.call('HGET', KEYS[3], 'native_delayed') ~= '1' then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
