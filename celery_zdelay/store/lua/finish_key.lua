-- A worker finished a task parked with on_key="until_finished": free its key.
--
-- KEYS[1] marks hash    (see _marks.lua)
-- KEYS[2] due zset      id -> due_ms * 1024 + seq
-- KEYS[3] lease zset    id -> lease expiry ms
-- KEYS[4] msg hash      id -> payload
-- ARGV[1] key
-- ARGV[2] task id
-- returns 1 when the key was freed (or will be, when the release is
--         acknowledged), 0 when another entry owns it or it is parked again
--         (waiting, or held back by a pause or rate limit: see _where.lua)
local marks, due, key, id = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
zdelay_expect(marks, 'hash', due, 'zset', KEYS[3], 'zset', KEYS[4], 'hash')
local owner, until_ms = zdelay_mark_owner(redis.call('HGET', marks, 'k:' .. key))
if owner ~= id then return 0 end
if until_ms then
  zdelay_t_key_free(marks, 'k:' .. key)
  return 1
end
-- Released through the generic path and run before the companion's ack
-- (in flight), or parked again under the same id: then it owns the key,
-- untouched, whether it waits or is held back.
local state = zdelay_where({due = due, lease = KEYS[3], msg = KEYS[4]}, id)
if state == 'due' or state == 'held' then return 0 end
-- A run that ended at 0: free now, and the ack (see _marks.lua) removes it.
zdelay_t_key_take(marks, 'k:' .. key, id .. '\n0')
return 1
