-- Return entries whose lease expired (their companion died or stalled) to
-- the due set at their original due time, so they are released again.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- ARGV[1] most entries to recover
-- returns the number of entries recovered
if redis.replicate_commands then redis.replicate_commands() end
local lease, leased, due = KEYS[1], KEYS[2], KEYS[3]
zdelay_expect(lease, 'zset', leased, 'hash', due, 'zset')
local now_ms = zdelay_now_ms()
local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
if #expired == 0 then return 0 end
local values = redis.call('HMGET', leased, unpack(expired))
local scores = {}
for j = 1, #expired do
  -- A leased record that is missing or unreadable: due now rather than lost.
  scores[j] = zdelay_due_score(values[j]) or now_ms * 1024
end
zdelay_t_recover({due = due, lease = lease, leased = leased}, expired, scores)
return #expired
