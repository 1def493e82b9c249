-- Put dead-lettered entries back, due now, with their original payload.
--
-- KEYS[1] dead zset     id -> dead-lettered at ms
-- KEYS[2] dead hash     id -> reason JSON "\n" payload
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- KEYS[4] msg hash      id -> payload
-- KEYS[5] lease zset    id -> lease expiry ms (entries being released)
-- ARGV[1] wake channel (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2..] ids
-- returns one flag per id: 1 requeued; 0 not dead-lettered, without payload,
--         or parked again under the same id (waiting, or being released)
if redis.replicate_commands then redis.replicate_commands() end
local dead, dead_msg, due, msg, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
zdelay_expect(dead, 'zset', dead_msg, 'hash', due, 'zset', msg, 'hash', lease, 'zset')
local now_ms = zdelay_now_ms()
local result = {}
local chosen = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local stored = redis.call('HGET', dead_msg, id)
  result[i - 1] = 0
  -- An id parked again since it died keeps its new entry, whether it is
  -- waiting or in flight: overwriting the payload of an in-flight entry
  -- would let its release acknowledge (delete) the requeued one.
  if stored and not redis.call('ZSCORE', due, id) and not redis.call('ZSCORE', lease, id) then
    local nl = string.find(stored, '\n', 1, true)
    local payload = nl and string.sub(stored, nl + 1) or ''
    if payload ~= '' then
      chosen[#chosen + 1] = {id, payload}
      result[i - 1] = 1
    end
  end
end
for _, entry in ipairs(chosen) do
  redis.call('HSET', msg, entry[1], entry[2])
  redis.call('ZADD', due, now_ms * 1024, entry[1])
  redis.call('ZREM', dead, entry[1])
  redis.call('HDEL', dead_msg, entry[1])
end
if #chosen > 0 then zdelay_wake(ARGV[1], now_ms) end
return result
