-- Hand claimed entries off into the Redis broker's queue lists, after the
-- companion has read and checked them (signed entries are verified in
-- Python, as Lua has no HMAC-SHA256). The companion sends the envelope it
-- checked; this script pushes exactly those bytes and never rereads the
-- payload or its template, so what is published is what was verified, even
-- if someone rewrote the entry meanwhile. Removing the lease and pushing
-- happen in this one script, so each entry is delivered exactly once.
--
-- KEYS[1] lease zset    id -> lease expiry ms
-- KEYS[2] leased hash   id -> "<due score> <claim token>"
-- KEYS[3] msg hash      id -> payload
-- KEYS[4] tags counter  source of unique kombu delivery tags
-- KEYS[5] templates hash  (only their reference counts change here)
-- KEYS[6..] kombu queue list keys
-- KEYS[#KEYS - 1] marks hash, KEYS[#KEYS] tagged zset (keys and tags, see
--                 _marks.lua), after the list keys
-- ARGV[1] claim token
-- ARGV[2] delivery tag prefix
-- ARGV[3..] triples: id, index of its list key among KEYS[6..] (1 = KEYS[6]),
--           envelope up to the delivery tag's opening quote
-- returns {{ids pushed}, {id, reason, ...: entries refused}}; an id this
--         claim no longer owns is in neither (its new owner releases it)
local lease, leased, msg, tags, templates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token, tag_prefix = tonumber(ARGV[1]), ARGV[2]
local marks, tagged = KEYS[#KEYS - 1], KEYS[#KEYS]
zdelay_expect(lease, 'zset', leased, 'hash', msg, 'hash', templates, 'hash')
zdelay_expect_counter(tags)

local kinds, seen = {}, {}
local pushed, bodies, refused = {}, {}, {}
for i = 3, #ARGV, 3 do
  local id, dest, head = ARGV[i], KEYS[5 + tonumber(ARGV[i + 1])], ARGV[i + 2]
  if dest and zdelay_owned(lease, leased, id, token, seen) then
    local kind = kinds[dest]
    if not kind then
      kind = redis.call('TYPE', dest)['ok']
      kinds[dest] = kind
    end
    if kind == 'list' or kind == 'none' then
      pushed[#pushed + 1] = id
      bodies[#bodies + 1] = {dest, head}
    else
      refused[#refused + 1] = id
      refused[#refused + 1] = 'queue list ' .. dest .. ' is a ' .. kind .. ' key, not a list, ' ..
        'so the Redis broker cannot deliver to it: delete or rename that key, then requeue this entry'
    end
  end
end
-- Pushed entries no longer refer to their templates (read before writing).
local released_templates = {}
for _, id in ipairs(pushed) do
  zdelay_count(released_templates, zdelay_template_id(redis.call('HGET', msg, id)), -1)
end
local refs = zdelay_refs_plan(templates, released_templates)
local marks_plan = zdelay_marks_plan(marks, tagged, pushed, 'release')
if #pushed > 0 then
  local tag = redis.call('INCRBY', tags, #pushed) - #pushed
  for k, item in ipairs(bodies) do
    tag = tag + 1
    redis.call('LPUSH', item[1], item[2] .. tag_prefix .. tag .. '"}}')
  end
  zdelay_t_release({lease = lease, leased = leased, msg = msg, templates = templates,
    marks = marks, tagged = tagged}, pushed, true, refs, nil, marks_plan)
end
return {pushed, refused}
