-- Claim due entries for release through the broker: due -> lease.
--
-- Claim moves ids into the lease set in the same script, so a companion that
-- dies after this call loses nothing: recover.lua returns them when the lease
-- expires. Every read and check comes before the first write (_guard.lua).
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- KEYS[3] lease zset    id -> lease expiry ms
-- KEYS[4] leased hash   id -> "<due score> <claim token>"
-- KEYS[5] tags counter  source of unique claim tokens (and delivery tags)
-- ARGV[1] lease length ms
-- ARGV[2] most entries to claim
-- ARGV[3] ms to add to the Redis clock when picking due entries: 0, except
--         in tests that fast-forward time (celery_zdelay.testing)
-- returns {now_ms, token, next_due_ms, next_lease_expiry_ms, id, due_score, payload, ...}
--         next_* are -1 when there is none; payload is nil when it is missing
if redis.replicate_commands then redis.replicate_commands() end

local due, msg, lease, leased, tags = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease_ms, limit, advance_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3] or 0)
zdelay_expect(due, 'zset', msg, 'hash', lease, 'zset', leased, 'hash')
zdelay_expect_counter(tags)
local now_ms = zdelay_now_ms()
local expiry = now_ms + lease_ms

local claimed = redis.call('ZRANGEBYSCORE', due, '-inf', (now_ms + advance_ms) * 1024 + 1023, 'WITHSCORES', 'LIMIT', 0, limit)
local n = #claimed / 2
local token = 0
local result = {now_ms, token, -1, -1}
if n > 0 then
  local ids = {}
  for i = 1, #claimed, 2 do ids[#ids + 1] = claimed[i] end
  local payloads = redis.call('HMGET', msg, unpack(ids))
  token = redis.call('INCR', tags)
  result[2] = token
  local entries = {}
  for j = 1, n do
    local id, score = claimed[2 * j - 1], claimed[2 * j]
    entries[j] = {id, score}
    result[#result + 1] = id
    result[#result + 1] = tonumber(score)
    result[#result + 1] = payloads[j]
  end
  -- The claimed entries are exactly the n lowest ranks (KEYS[1] is a held
  -- set when a control releases what it held: see control.py).
  zdelay_t_claim({lease = lease, leased = leased}, due, entries, token, expiry)
end

zdelay_next_events(result, due, lease)
return result
