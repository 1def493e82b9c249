-- Cancel claimed entries that went stale (zdelay_on_stale = "drop"), if this
-- claim still owns them: in flight -> gone, in one step, so a stale entry is
-- never both cancelled and still leased, nor lost in between.
--
-- An entry is owned while its leased record carries the claim's token: a
-- lease that expired and was claimed again, or an id parked again meanwhile,
-- is left alone.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] templates hash  (only their reference counts change here)
-- KEYS[5] marks hash    (with KEYS[6]: keys and tags, see _marks.lua)
-- KEYS[6] tagged zset
-- ARGV[1] claim token
-- ARGV[2..] ids
-- returns the ids cancelled
if redis.replicate_commands then redis.replicate_commands() end
local lease, leased, msg, templates, marks, tagged = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local token = tonumber(ARGV[1])
zdelay_expect(lease, 'zset', leased, 'hash', msg, 'hash', templates, 'hash')
local owned, entries, released_templates, seen = {}, {}, {}, {}
for i = 2, #ARGV do
  local id = ARGV[i]
  if zdelay_owned(lease, leased, id, token, seen) then
    owned[#owned + 1] = id
    entries[#entries + 1] = {id, lease}
    zdelay_count(released_templates, zdelay_template_id(redis.call('HGET', msg, id)), -1)
  end
end
local refs = zdelay_refs_plan(templates, released_templates)
local marks_plan = zdelay_marks_plan(marks, tagged, owned, 'cancel')
zdelay_t_cancel({lease = lease, leased = leased, msg = msg, templates = templates,
  marks = marks, tagged = tagged}, entries, refs, marks_plan)
return owned
