-- Cancel parked entries that have not been claimed for release yet.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- KEYS[3] templates hash  (optional: only their reference counts change here)
-- KEYS[4] marks hash    (optional, with KEYS[5]: keys and tags, see _marks.lua)
-- KEYS[5] tagged zset
-- ARGV[1..] ids
-- returns one flag per id: 1 cancelled, 0 not parked (unknown, or released)
local due, msg, templates, marks, tagged = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
zdelay_expect(due, 'zset', msg, 'hash')
if templates then zdelay_expect(templates, 'hash') end
local result, parked, released_templates = {}, {}, {}
for i = 1, #ARGV do
  local id = ARGV[i]
  result[i] = 0
  if not parked[id] and redis.call('ZSCORE', due, id) then
    parked[id] = true
    result[i] = 1
    if templates then
      zdelay_count(released_templates, zdelay_template_id(redis.call('HGET', msg, id)), -1)
    end
  end
end
local refs = templates and zdelay_refs_plan(templates, released_templates) or {}
local gone = {}
for i = 1, #ARGV do if result[i] == 1 then gone[#gone + 1] = ARGV[i] end end
local marks_plan = marks and zdelay_marks_plan(marks, tagged, gone, 'cancel')
local entries = {}
for i, id in ipairs(gone) do entries[i] = {id, due} end
zdelay_t_cancel({due = due, msg = msg, templates = templates, marks = marks, tagged = tagged},
  entries, templates and refs, marks_plan)
return result
