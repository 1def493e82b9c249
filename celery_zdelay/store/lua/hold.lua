-- Hold claimed entries back, under a pause or a rate limit: lease -> held set.
--
-- A held entry stays parked in Redis with its due score, in a sorted set of
-- its own per control and shard, so the claims of due entries never wade
-- through it and it is released in due order when the control allows.
-- The held set is named in the lanes set in the same step, so a companion
-- that drains the lanes of a removed control always finds it.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] held zset     id -> due_ms * 1024 + seq
-- KEYS[4] lanes set     names of the controls with a held set on this shard
-- ARGV[1] claim token
-- ARGV[2] control name
-- ARGV[3..] ids
-- returns the number of entries held
local lease, leased, held, lanes = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token = tonumber(ARGV[1])
zdelay_expect(lease, 'zset', leased, 'hash', held, 'zset', lanes, 'set')
local owned, once = {}, {}
for i = 3, #ARGV do
  local score = zdelay_number(zdelay_owned(lease, leased, ARGV[i], token, once))
  if score then owned[#owned + 1] = {ARGV[i], score} end
end
zdelay_t_hold({lease = lease, leased = leased, lanes = lanes}, held, ARGV[2], owned)
return #owned
