-- Put dead-lettered entries back, due now, with their original payload.
--
-- KEYS[1] dead zset     id -> dead-lettered at ms
-- KEYS[2] dead hash     id -> reason JSON "\n" payload
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- KEYS[4] msg hash      id -> payload
-- ARGV[1] wake channel
-- ARGV[2..] ids
-- returns one flag per id: 1 requeued; 0 not dead-lettered, without payload,
--         or parked again under the same id
if redis.replicate_commands then redis.replicate_commands() end
local dead, dead_msg, due, msg = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result = {}
local requeued = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local stored = redis.call('HGET', dead_msg, id)
  result[i - 1] = 0
  -- An id parked again since it died keeps its new entry.
  if stored and not redis.call('ZSCORE', due, id) then
    local nl = string.find(stored, '\n', 1, true)
    local payload = nl and string.sub(stored, nl + 1) or ''
    if payload ~= '' then
      redis.call('HSET', msg, id, payload)
      redis.call('ZADD', due, now_ms * 1024, id)
      redis.call('ZREM', dead, id)
      redis.call('HDEL', dead_msg, id)
      result[i - 1] = 1
      requeued = requeued + 1
    end
  end
end
if requeued > 0 then redis.call('PUBLISH', ARGV[1], now_ms) end
return result
