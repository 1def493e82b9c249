-- Hand claimed entries off into the Redis broker's queue lists, after the
-- companion has checked them (signed entries are verified in Python, as Lua
-- has no HMAC-SHA256). Removing the lease and pushing happen in this one
-- script, so each entry is delivered exactly once.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> due score at claim time
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] tags counter  source of unique kombu delivery tags
-- KEYS[5] templates hash  template id -> template record (see entry.py)
-- KEYS[6..] kombu queue list keys
-- ARGV[1] claim token
-- ARGV[2] delivery tag prefix
-- ARGV[3..] pairs: id, index of its list key among KEYS[6..] (1 = KEYS[6])
-- returns the ids pushed
local lease, leased, msg, tags, templates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token, tag_prefix = tonumber(ARGV[1]), ARGV[2]
local pushed = {}
local bodies = {}
for i = 3, #ARGV, 2 do
  local id, dest = ARGV[i], KEYS[5 + tonumber(ARGV[i + 1])]
  local score = redis.call('ZSCORE', lease, id)
  if dest and score and tonumber(score) == token then
    local _, head = zdelay_read(templates, redis.call('HGET', msg, id))
    if head then
      pushed[#pushed + 1] = id
      bodies[#bodies + 1] = {dest, head}
    end
  end
end
if #pushed > 0 then
  local tag = redis.call('INCRBY', tags, #pushed) - #pushed
  for k, item in ipairs(bodies) do
    tag = tag + 1
    -- The stored envelope ends at the delivery tag's opening quote.
    redis.call('LPUSH', item[1], item[2] .. tag_prefix .. tag .. '"}}')
    redis.call('ZREM', lease, pushed[k])
    redis.call('HDEL', leased, pushed[k])
    redis.call('HDEL', msg, pushed[k])
  end
end
return pushed
