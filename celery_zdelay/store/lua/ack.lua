-- Forget entries the broker has accepted, if this claim still owns them.
--
-- An entry is owned while its leased record carries the claim's token: a
-- lease that expired and was claimed again, or an id parked again meanwhile,
-- is left alone so its new owner's payload survives.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] templates hash  (optional: only their reference counts change here)
-- KEYS[5] marks hash    (optional, with KEYS[6]: keys and tags, see _marks.lua)
-- KEYS[6] tagged zset
-- ARGV[1] claim token
-- ARGV[2..] ids
-- returns the number of entries acknowledged
local lease, leased, msg, templates = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local marks, tagged = KEYS[5], KEYS[6]
local token = tonumber(ARGV[1])
zdelay_expect(lease, 'zset', leased, 'hash', msg, 'hash')
if templates then zdelay_expect(templates, 'hash') end
local owned, released_templates = {}, {}
local once = {}
for i = 2, #ARGV do
  if zdelay_owned(lease, leased, ARGV[i], token, once) then
    owned[#owned + 1] = ARGV[i]
    if templates then
      zdelay_count(released_templates, zdelay_template_id(redis.call('HGET', msg, ARGV[i])), -1)
    end
  end
end
local refs = templates and zdelay_refs_plan(templates, released_templates) or {}
local marks_plan = marks and zdelay_marks_plan(marks, tagged, owned, 'release')
zdelay_t_release({lease = lease, leased = leased, msg = msg, templates = templates,
  marks = marks, tagged = tagged}, owned, true, templates and refs, nil, marks_plan)
return #owned
