-- Give claimed entries back, due again at their original time, because the
-- broker did not accept them. Only entries this claim still owns move.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- ARGV[1] claim token
-- ARGV[2..] ids
-- returns the number of entries given back
local lease, leased, due = KEYS[1], KEYS[2], KEYS[3]
local token = tonumber(ARGV[1])
zdelay_expect(lease, 'zset', leased, 'hash', due, 'zset')
local owned, once = {}, {}
for i = 2, #ARGV do
  local score = zdelay_number(zdelay_owned(lease, leased, ARGV[i], token, once))
  if score then owned[#owned + 1] = {ARGV[i], score} end
end
zdelay_t_unclaim({due = due, lease = lease, leased = leased}, owned)
return #owned
