-- Loaded in front of the scripts that remove entries (see scripts.py): the
-- keys and tags of entries ("marks", see celery_zdelay/store/marks.py) leave
-- with the entry, in the script that removes it, so the index is exact
-- after a crash at any instant. This file reads them and plans the writes;
-- the transition that moves the entry writes them (zdelay_marks_apply in
-- _transitions.lua).
--
-- marks hash   "i:<id>" -> record of a parked (or in-flight) entry
--              "d:<id>" -> record of a dead-lettered entry (requeue restores it)
--              "k:<key>" -> owner: "<id>" (parked or in flight), or
--                           "<id>\n<until ms>" (released, running: until_finished)
-- tagged zset  "<tag>\n<id>", score 0: entries by tag (ZRANGEBYLEX)
-- record       "<mode><max run ms>[ <field>...]\n<key>\n<tag>\n<tag>..."; mode "-" no key,
--              "k" keep, "r" replace, "d" debounce, "u" until_finished;
--              fields, each a letter and digits after a space (debounce):
--              "w<ms>" the burst's max_wait, "f<ms>" its first call (Redis
--              clock, written by park_keyed.lua). A record without them
--              (written before max_wait existed) is a burst of unknown start.

-- Returns mode, max run ms, key ('' for none), list of tags of *record*, and
-- its head's fields (letter -> number; one that is not digits is nil).
local function zdelay_mark_parse(record)
  local lines, start = {}, 1
  while true do
    local nl = string.find(record, '\n', start, true)
    if not nl then lines[#lines + 1] = string.sub(record, start); break end
    lines[#lines + 1] = string.sub(record, start, nl - 1)
    start = nl + 1
  end
  local head = lines[1]
  local tags = {}
  for i = 3, #lines do if lines[i] ~= '' then tags[#tags + 1] = lines[i] end end
  local fields = {}
  for name, value in string.gmatch(head, ' (%a)([^ ]*)') do
    fields[name] = string.match(value, '^%d+$') and tonumber(value) or nil
  end
  return string.sub(head, 1, 1), tonumber(string.match(head, '^.(%d*)')) or 0, lines[2] or '',
    tags, fields
end

-- *record* with its head's fields replaced by *fields* (letter -> number, in
-- the order of *names*; a nil one left out).
local function zdelay_mark_with(record, names, fields)
  -- The mode and max run ms, then the rest from the first line's end.
  local head, rest = string.match(record, '^([^ \n]*)[^\n]*(.*)$')
  for _, name in ipairs(names) do
    if fields[name] then head = head .. ' ' .. name .. string.format('%.0f', fields[name]) end
  end
  return head .. rest
end

-- Returns the id and, for a released entry, the ms its key is freed by (else nil).
local function zdelay_mark_owner(value)
  if not value then return nil, nil end
  local nl = string.find(value, '\n', 1, true)
  if not nl then return value, nil end
  return string.sub(value, 1, nl - 1), tonumber(string.sub(value, nl + 1)) or 0
end

-- Reads only (call before the first write). The writes that make the marks
-- of *ids* leave (for zdelay_marks_apply), as they leave the due set or the lease: *how* is
-- "release" (published: an until_finished key stays taken for its max run ms
-- from *now_ms*), "cancel" or "dead" (the record is kept for a requeue).
-- Returns nil when the shard has no marks at all: one EXISTS per call.
local function zdelay_marks_plan(marks, tagged, ids, how, now_ms)
  if #ids == 0 or redis.call('EXISTS', marks) == 0 then return nil end
  zdelay_expect(marks, 'hash', tagged, 'zset')
  local plan = {hdel = {}, hset = {}, zrem = {}}
  for k = 1, #ids, 1000 do
    local fields = {}
    for j = k, math.min(k + 999, #ids) do fields[#fields + 1] = 'i:' .. ids[j] end
    local records = redis.call('HMGET', marks, unpack(fields))
    for j, record in ipairs(records) do
      local id = ids[k + j - 1]
      if not record and how == 'dead' then
        -- It replaces the dead letter of its id: the record of that one
        -- (its key and tags, for a requeue) must not outlive it.
        plan.hdel[#plan.hdel + 1] = 'd:' .. id
      end
      if record then
        local mode, max_run_ms, key, tags = zdelay_mark_parse(record)
        plan.hdel[#plan.hdel + 1] = 'i:' .. id
        if how == 'dead' then
          plan.hset[#plan.hset + 1] = {'d:' .. id, record}
        end
        for _, tag in ipairs(tags) do plan.zrem[#plan.zrem + 1] = tag .. '\n' .. id end
        if key ~= '' then
          local owner, until_ms = zdelay_mark_owner(redis.call('HGET', marks, 'k:' .. key))
          if owner == id then
            if how == 'release' and mode == 'u' and until_ms == nil then
              local ends = string.format('%.0f', (now_ms or zdelay_now_ms()) + max_run_ms)
              plan.hset[#plan.hset + 1] = {'k:' .. key, id .. '\n' .. ends}
            else
              -- Also a run a worker ended before the release was acknowledged.
              plan.hdel[#plan.hdel + 1] = 'k:' .. key
            end
          end
        end
      end
    end
  end
  return plan
end
