-- Release due entries straight into the Redis broker's queue lists, in one
-- atomic step: there is no moment at which an entry is both in a queue and
-- still parked, so each is delivered exactly once. Entries that cannot be
-- handed off (no destination, another transport layout, unknown schema,
-- damaged payload) are leased for the companion's generic path instead.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- KEYS[3] lease zset    id -> lease expiry ms
-- KEYS[4] leased hash   id -> due score at claim time
-- KEYS[5] tags counter  source of unique kombu delivery tags
-- KEYS[6] templates hash  template id -> template record (see entry.py)
-- KEYS[7..] kombu queue list keys this companion may push to
-- ARGV[1] lease length ms (for entries taking the generic path)
-- ARGV[2] most entries to claim
-- ARGV[3] the broker's transport layout fingerprint
-- ARGV[4] delivery tag prefix
-- ARGV[5] "1" when KEYS[7..] were just read from the dests set: an entry
--         naming a list key outside them is leased instead of waiting
-- ARGV[6] ms to add to the Redis clock when picking due entries: 0, except
--         in tests that fast-forward time (celery_zdelay.testing)
-- returns {now_ms, token, next_due_ms, next_lease_expiry_ms, needs_dests,
--          n_leased, id, due_score, payload (n_leased times),
--          due_ms of each entry handed off}
if redis.replicate_commands then redis.replicate_commands() end

local due, msg, lease, leased, tags, templates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local lease_ms, limit, layout, tag_prefix, fresh, advance_ms =
  tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5] == '1', tonumber(ARGV[6] or 0)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = now_ms + lease_ms

local known = {}
for i = 7, #KEYS do known[KEYS[i]] = true end

-- The destination list and envelope head of a payload, or nil when it must
-- take the generic path.
local function destination(payload)
  local meta, head = zdelay_read(templates, payload)
  if not meta or type(meta.k) ~= 'string' or meta.l ~= layout or meta.s ~= nil then
    return nil
  end
  return meta.k, head
end

local claimed = redis.call('ZRANGEBYSCORE', due, '-inf', (now_ms + advance_ms) * 1024 + 1023, 'WITHSCORES', 'LIMIT', 0, limit)
local payloads = {}
if #claimed > 0 then
  local ids = {}
  for i = 1, #claimed, 2 do ids[#ids + 1] = claimed[i] end
  payloads = redis.call('HMGET', msg, unpack(ids))
end

local pushes, order, handed, handed_due, generic = {}, {}, {}, {}, {}
local taken, needs_dests = 0, 0
for j = 1, #claimed / 2 do
  local id, score, payload = claimed[2 * j - 1], claimed[2 * j], payloads[j]
  local dest, head = destination(payload)
  if dest and not known[dest] and not fresh then
    -- Stop here, leaving this entry and later ones parked, so the caller can
    -- reread the dests set and keep the release order.
    needs_dests = 1
    break
  end
  taken = j
  if dest and known[dest] then
    if not pushes[dest] then pushes[dest] = {}; order[#order + 1] = dest end
    local list = pushes[dest]
    list[#list + 1] = head
    handed[#handed + 1] = id
    handed_due[#handed_due + 1] = math.floor(tonumber(score) / 1024)
  else
    generic[#generic + 1] = {id, score, payload}
  end
end

if taken > 0 then
  redis.call('ZREMRANGEBYRANK', due, 0, taken - 1)
end

local result = {now_ms, token, -1, -1, needs_dests, #generic}
if #handed > 0 then
  local last = redis.call('INCRBY', tags, #handed)
  local tag = last - #handed
  for _, dest in ipairs(order) do
    local bodies = pushes[dest]
    local batch = {}
    for k = 1, #bodies do
      tag = tag + 1
      -- The stored envelope ends at the delivery tag's opening quote.
      batch[#batch + 1] = bodies[k] .. tag_prefix .. tag .. '"}}'
      if #batch == 1000 then
        redis.call('LPUSH', dest, unpack(batch))
        batch = {}
      end
    end
    if #batch > 0 then redis.call('LPUSH', dest, unpack(batch)) end
  end
  for k = 1, #handed, 1000 do
    redis.call('HDEL', msg, unpack(handed, k, math.min(k + 999, #handed)))
  end
end

for _, entry in ipairs(generic) do
  redis.call('ZADD', lease, token, entry[1])
  redis.call('HSET', leased, entry[1], entry[2])
  result[#result + 1] = entry[1]
  result[#result + 1] = tonumber(entry[2])
  result[#result + 1] = entry[3]
end

for _, due_ms in ipairs(handed_due) do result[#result + 1] = due_ms end

local head = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
if head[2] then result[3] = math.floor(tonumber(head[2]) / 1024) end
local first_lease = redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')
if first_lease[2] then result[4] = tonumber(first_lease[2]) end
return result
