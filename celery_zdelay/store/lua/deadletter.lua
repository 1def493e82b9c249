-- Move claimed entries that cannot be published to the dead-letter set,
-- keeping their payload and the reason, so one bad entry never holds up the
-- entries behind it.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] dead zset     id -> dead-lettered at ms
-- KEYS[5] dead hash     id -> reason JSON "\n" payload
-- KEYS[6] marks hash    (optional, with KEYS[7]: keys and tags, see _marks.lua)
-- KEYS[7] tagged zset
-- ARGV[1] claim token
-- ARGV[2..] pairs: id, reason JSON (one line)
-- returns the number of entries dead-lettered
if redis.replicate_commands then redis.replicate_commands() end
local lease, leased, msg, dead, dead_msg = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local marks, tagged = KEYS[6], KEYS[7]
local token = tonumber(ARGV[1])
zdelay_expect(lease, 'zset', leased, 'hash', msg, 'hash', dead, 'zset', dead_msg, 'hash')
local now_ms = zdelay_now_ms()
local owned, once = {}, {}
for i = 2, #ARGV, 2 do
  if zdelay_owned(lease, leased, ARGV[i], token, once) then
    owned[#owned + 1] = {ARGV[i], ARGV[i + 1], redis.call('HGET', msg, ARGV[i]) or ''}
  end
end
local gone = {}
for _, entry in ipairs(owned) do gone[#gone + 1] = entry[1] end
local marks_plan = marks and zdelay_marks_plan(marks, tagged, gone, 'dead', now_ms)
zdelay_t_bury({lease = lease, leased = leased, msg = msg, dead = dead, dead_msg = dead_msg,
  marks = marks, tagged = tagged}, owned, true, now_ms, marks_plan)
return #owned
