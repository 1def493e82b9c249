-- Release due entries straight into the Redis broker's queue lists, in one
-- atomic step: there is no moment at which an entry is both in a queue and
-- still parked, so each is delivered exactly once. Entries that cannot be
-- handed off (no destination, another transport layout, unknown schema,
-- damaged payload) are leased for the companion's generic path instead, and
-- so are stale entries (released later than their max_late: see
-- celery_zdelay/stale.py), for the companion to dead-letter, drop or run;
-- an entry whose queue list key holds another type (which LPUSH would refuse
-- halfway through the script) is dead-lettered with that reason. Every check
-- comes before the first write (_guard.lua).
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- KEYS[3] lease zset    id -> lease expiry ms
-- KEYS[4] leased hash   id -> "<due score> <claim token>"
-- KEYS[5] tags counter  source of unique kombu delivery tags and claim tokens
-- KEYS[6] templates hash  template id -> template record (see entry.py)
-- KEYS[7] dead zset     id -> dead-lettered at ms
-- KEYS[8] dead hash     id -> reason JSON "\n" payload
-- KEYS[9..] kombu queue list keys this companion may push to
-- KEYS[#KEYS - 1] marks hash, KEYS[#KEYS] tagged zset (keys and tags, see
--                 _marks.lua), after the list keys
-- ARGV[1] lease length ms (for entries taking the generic path)
-- ARGV[2] most entries to claim
-- ARGV[3] the broker's transport layout fingerprint
-- ARGV[4] delivery tag prefix
-- ARGV[5] "1" when KEYS[9..] were just read from the dests set: an entry
--         naming a list key outside them is leased instead of waiting
-- ARGV[6] ms to add to the Redis clock when picking due entries: 0, except
--         in tests that fast-forward time (celery_zdelay.testing)
-- ARGV[7] companion id, written into dead-letter reasons
-- ARGV[8] "1": return the id of each entry handed off too (zdelay_audit_log,
--         periodic runs); anything else: their due scores only
-- ARGV[9] queue list keys of paused or rate-limited queues, joined by "\n"
--         (empty: none): their entries are leased, for the companion's gate
--         to hold, instead of handed off
-- ARGV[10] the companion's zdelay_max_late in ms (empty: none), for entries
--          parked without their own ("m" in their metadata line, entry.py)
-- ARGV[11] ms ahead of its due time an entry may be handed off
--          (zdelay_release_ahead_seconds; empty or 0: none): such an entry
--          is pushed with its "eta" header set to its due time, so the
--          worker's ETA timer starts it then, or, when its headers do not
--          allow that (zdelay_with_eta), leased for the companion
-- returns {now_ms, token, next_due_ms, next_lease_expiry_ms, needs_dests,
--          n_leased, n_dead, id, due_score, payload (n_leased times),
--          id, reason JSON (n_dead times), [id of each entry handed off,]
--          the due scores of the entries handed off, joined by commas}
--          (one string: a reply element per entry costs the caller more to
--          read than the whole string)
if redis.replicate_commands then redis.replicate_commands() end

local due, msg, lease, leased, tags, templates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local dead, dead_msg = KEYS[7], KEYS[8]
local marks, tagged = KEYS[#KEYS - 1], KEYS[#KEYS]
local lease_ms, limit, layout, tag_prefix, fresh, advance_ms, companion =
  tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5] == '1', tonumber(ARGV[6] or 0), ARGV[7]
zdelay_expect(due, 'zset', msg, 'hash', lease, 'zset', leased, 'hash', templates, 'hash',
  dead, 'zset', dead_msg, 'hash')
local tag_base = zdelay_expect_counter(tags)
local now_ms = zdelay_now_ms()
local expiry = now_ms + lease_ms

local default_late_ms = tonumber(ARGV[10] or '')
local ahead_ms = tonumber(ARGV[11] or '') or 0

-- Whether an entry claimed now is stale: released later than its own
-- max_late (first in its metadata line, after the parked-at stamp), else
-- the companion's. No limit is under a second (stale.py), so an entry
-- released within a second of its due time costs one subtraction; a late
-- one an anchored match on its first bytes. Periodic occurrences follow
-- their schedule's zdelay_missed instead (their ids: stale.py).
local function stale(id, score, payload)
  local late_ms = now_ms - math.floor(tonumber(score) / 1024)
  if late_ms <= 1000 then return false end
  local limit = payload and (string.match(payload, '^{"p":%d+,"m":(%d+),')
    or string.match(payload, '^{"m":(%d+),'))
  limit = tonumber(limit) or default_late_ms
  return limit ~= nil and late_ms > limit and string.sub(id, 1, 9) ~= 'periodic:'
end

local known = {}
for i = 9, #KEYS - 2 do known[KEYS[i]] = true end
local held_dests = {}
for dest in string.gmatch(ARGV[9] or '', '[^\n]+') do held_dests[dest] = true end

-- What each queue list key holds now: a key of another type would make
-- LPUSH fail after entries were removed from the due set.
local dest_types = {}
local function dest_type(dest)
  local kind = dest_types[dest]
  if not kind then
    kind = redis.call('TYPE', dest)['ok']
    dest_types[dest] = kind
  end
  return kind
end

-- Where a payload goes: its destination list; its template and where its
-- values start (the form parked by default), or its envelope head (other
-- forms), or neither (a message stored whole, pushed as it is); and the id
-- of the template or route record it refers to (false for none). nil when
-- it must take the generic path.
local function destination(payload)
  if not payload then return nil end
  local b1, b2, b3 = string.byte(payload, 1, 3)
  if b3 == 98 and b1 == 123 and b2 == 34 then  -- {"b: stored whole, or nothing of ours
    local rid = zdelay_template_id(payload)
    local route = rid and zdelay_whole_route(templates, rid)
    if not route or type(route.k) ~= 'string' or route.l ~= layout then return nil end
    return route.k, nil, nil, rid
  end
  local template, pos = zdelay_fast_entry(templates, payload)
  if template then
    if type(template.k) ~= 'string' or template.l ~= layout then return nil end
    return template.k, template, pos, template.tid
  end
  local meta, head = zdelay_read(templates, payload)
  if not meta or type(meta.k) ~= 'string' or meta.l ~= layout or meta.s ~= nil then
    return nil
  end
  return meta.k, nil, head, zdelay_template_id(payload) or false
end

local claimed = redis.call('ZRANGEBYSCORE', due, '-inf', (now_ms + advance_ms + ahead_ms) * 1024 + 1023, 'WITHSCORES', 'LIMIT', 0, limit)
local payloads = {}
if #claimed > 0 then
  local ids = {}
  for i = 1, #claimed, 2 do ids[(i + 1) / 2] = claimed[i] end
  payloads = redis.call('HMGET', msg, unpack(ids))
end

-- Every message is built here, with its delivery tag, before the first write.
local pushes, order, handed, handed_scores, generic, bad = {}, {}, {}, {}, {}, {}
local released_templates = {}
local taken, needs_dests, n_handed = 0, 0, 0
-- The list of the previous entry's destination: most batches have one.
local last_dest, last_list
for j = 1, #claimed / 2 do
  local id, score, payload = claimed[2 * j - 1], claimed[2 * j], payloads[j]
  local dest, template, rest, tid
  if not stale(id, score, payload) then dest, template, rest, tid = destination(payload) end
  if dest and held_dests[dest] then dest = nil end
  if dest and not known[dest] and not fresh then
    -- Stop here, leaving this entry and later ones parked, so the caller can
    -- reread the dests set and keep the release order.
    needs_dests = 1
    break
  end
  taken = j
  local kind = dest and known[dest] and dest_type(dest)
  local message
  if kind == 'list' or kind == 'none' then
    if template then
      message = zdelay_render(template, payload, rest, tag_prefix .. (tag_base + n_handed + 1) .. '"}}')
    elseif rest then
      -- The stored envelope ends at the delivery tag's opening quote.
      message = rest .. tag_prefix .. (tag_base + n_handed + 1) .. '"}}'
    else
      -- Stored whole, with the delivery tag chosen when it was parked.
      message = payload
    end
  end
  local due_ms = math.floor(tonumber(score) / 1024)
  if message and ahead_ms > 0 and due_ms > now_ms + advance_ms then
    -- Released ahead: the worker's ETA timer holds it until due, never
    -- starting it before (the message's eta is its due time).
    message = zdelay_with_eta(message, due_ms)
  end
  if message then
    zdelay_count(released_templates, tid or nil, -1)
    if dest ~= last_dest then
      last_list = pushes[dest]
      if not last_list then last_list = {}; pushes[dest] = last_list; order[#order + 1] = dest end
      last_dest = dest
    end
    last_list[#last_list + 1] = message
    n_handed = n_handed + 1
    handed[n_handed] = id
    handed_scores[n_handed] = score  -- due_ms * 1024 + sequence: the caller divides
  elseif kind and kind ~= 'list' and kind ~= 'none' then
    bad[#bad + 1] = {id, zdelay_reason('queue list ' .. dest .. ' is a ' .. kind ..
      ' key, not a list, so the Redis broker cannot deliver to it: delete or rename that ' ..
      'key, then requeue this entry', due_ms, companion), payload}
  else
    generic[#generic + 1] = {id, score, payload}
  end
end

-- Released entries no longer refer to their templates (read before writing);
-- the entries this call leases or dead-letters still do, counted or not.
local still_used = {}
for _, entry in ipairs(generic) do
  local tid = zdelay_template_id(entry[3])
  if tid then still_used[tid] = true end
end
for _, entry in ipairs(bad) do
  local tid = zdelay_template_id(entry[3])
  if tid then still_used[tid] = true end
end
local refs = zdelay_refs_plan(templates, released_templates)
-- Released and dead-lettered entries take their keys and tags with them.
local handed_marks = zdelay_marks_plan(marks, tagged, handed, 'release', now_ms)
local bad_ids = {}
for _, entry in ipairs(bad) do bad_ids[#bad_ids + 1] = entry[1] end
local bad_marks = zdelay_marks_plan(marks, tagged, bad_ids, 'dead', now_ms)

local s = {due = due, msg = msg, lease = lease, leased = leased, templates = templates,
  dead = dead, dead_msg = dead_msg, marks = marks, tagged = tagged}
-- The first *taken* entries leave the due set: each is handed off
-- (released), leased or dead-lettered below, in this script.
zdelay_t_take(due, taken)

local result = {now_ms, 0, -1, -1, needs_dests, #generic, #bad}
if #handed > 0 then
  redis.call('INCRBY', tags, #handed)
  for _, dest in ipairs(order) do
    local messages = pushes[dest]
    for k = 1, #messages, 1000 do
      redis.call('LPUSH', dest, unpack(messages, k, math.min(k + 999, #messages)))
    end
  end
end
zdelay_t_release(s, handed, false, #handed > 0 and refs, still_used, handed_marks, handed_scores)

local token = 0
if #generic > 0 then token = redis.call('INCR', tags) end
result[2] = token

zdelay_t_lease(s, generic, token, expiry)
for _, entry in ipairs(generic) do
  result[#result + 1] = entry[1]
  result[#result + 1] = tonumber(entry[2])
  result[#result + 1] = entry[3]
end

zdelay_t_bury(s, bad, false, now_ms, bad_marks)
for _, entry in ipairs(bad) do
  result[#result + 1] = entry[1]
  result[#result + 1] = entry[2]
end

if ARGV[8] == '1' then
  for i = 1, n_handed do result[#result + 1] = handed[i] end
end
result[#result + 1] = table.concat(handed_scores, ',')

zdelay_next_events(result, due, lease)
return result
