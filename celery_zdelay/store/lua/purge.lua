-- Delete dead-lettered entries for good, and the template counts they held.
--
-- KEYS[1] dead zset     id -> dead-lettered at ms
-- KEYS[2] dead hash     id -> reason JSON "\n" payload
-- KEYS[3] templates hash  (only their reference counts change here)
-- KEYS[4] marks hash    (optional: the keys and tags a requeue would restore)
-- ARGV[1..] ids (at most a few thousand: one call)
-- returns the number of entries removed from the dead zset
local dead, dead_msg, templates, marks = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
zdelay_expect(dead, 'zset', dead_msg, 'hash', templates, 'hash')
if #ARGV == 0 then return 0 end
local released, seen = {}, {}
for i = 1, #ARGV do
  local id = ARGV[i]
  if not seen[id] then
    seen[id] = true
    local stored = redis.call('HGET', dead_msg, id)
    local nl = stored and string.find(stored, '\n', 1, true)
    if nl then zdelay_count(released, zdelay_template_id(string.sub(stored, nl + 1)), -1) end
  end
end
local refs = zdelay_refs_plan(templates, released)
local marked = marks and redis.call('EXISTS', marks) == 1
if marked then zdelay_expect(marks, 'hash') end
return zdelay_t_purge({dead = dead, dead_msg = dead_msg, templates = templates, marks = marks},
  ARGV, refs, marked)
