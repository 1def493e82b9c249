-- Loaded in front of every script that moves an entry (see scripts.py):
-- the transitions of a parked id's state, each written once here and called
-- by every script that makes that move. They are the only writers of the
-- state keys (due, msg, lease, leased, the held sets and the lanes set,
-- dead, dead hash, the key and tag index of the marks hash and the tagged
-- zset, and the templates' reference counts), so a state added later is
-- added here once and no script misses it (tests/store/test_transitions_only.py).
--
-- States of an id on its shard (see _where.lua for how a script reads them):
--   due        due zset (score due_ms * 1024 + seq) + payload in msg
--   held       a held zset named in the lanes set + payload in msg
--   in flight  lease zset (expiry) + leased hash ("<due score> <token>") + payload
--   dead       dead zset (at ms) + dead hash ("<reason JSON>\n<payload>"),
--              its marks kept as "d:<id>" for a requeue
--   gone       none of these; an until_finished key may stay taken by the id
--              (marks "k:<key>" -> "<id>\n<until ms>": a running key owner)
--
-- Transitions (function: from -> to; scripts that call it):
--   zdelay_t_park       new, due, held, in flight -> due   park, park_keyed
--   zdelay_t_index      the key and tags of an entry parked   park_keyed, requeue
--   zdelay_t_claim      due or held -> in flight            claim
--   zdelay_t_take       due -> (released, leased or dead in the same script)  handoff
--   zdelay_t_lease      (taken) -> in flight                handoff
--   zdelay_t_unclaim    in flight -> due (given back)       unclaim
--   zdelay_t_recover    in flight -> due (lease expired)    recover
--   zdelay_t_hold       in flight -> held                   hold
--   zdelay_t_forget_lane  an empty held set unnamed        forget_lane
--   zdelay_t_release    in flight or taken -> gone, marks leave "release"
--                                                           ack, push, handoff
--   zdelay_t_cancel     due, held or in flight -> gone, marks leave "cancel"
--                                                           cancel, park_keyed, periodic withdraw,
--                                                           drop_stale
--   zdelay_t_bury       in flight or taken -> dead, marks kept as "d:"
--                                                           deadletter, handoff
--   zdelay_t_requeue    dead -> due                         requeue
--   zdelay_t_purge      dead -> gone                        purge
--   zdelay_t_reschedule due or held -> due at a new score   reschedule
--   zdelay_t_key_take   a key taken by a run, or its one waiting run
--                                                           finish_key, start_run
--   zdelay_t_key_free   a key's owner forgotten            finish_key, start_run, drop_key
--
-- None of them reads or checks anything: a script reads and checks all it
-- needs first (_guard.lua, zdelay_marks_plan, zdelay_refs_plan), then calls
-- them, so no command after its first write can fail and no transition is
-- left half done. Commands that take many ids take up to 1000 at a time.
--
-- *s* names a shard's keys: {due =, msg =, lease =, leased =, dead =,
-- dead_msg =, templates =, marks =, tagged =, lanes =}; a transition uses
-- only those of its move (a script passes what it was given).
--
-- Each transition that a task's history shows (parked, rescheduled, held,
-- released, cancelled, dead-lettered, requeued, purged) records it with
-- the zdelay_h_* functions of _history.lua: nothing when the caller did
-- not ask (zdelay_history_seconds = 0).

-- *cmd* on *key* for items first..last of *items*, 1000 at a time.
local function zdelay_t_each(cmd, key, items, first, last)
  first, last = first or 1, last or #items
  for k = first, last, 1000 do
    redis.call(cmd, key, unpack(items, k, math.min(k + 999, last)))
  end
end

-- Writes *plan* (from zdelay_marks_plan in _marks.lua; nil: nothing to do).
local function zdelay_marks_apply(marks, tagged, plan)
  if not plan then return end
  zdelay_t_each('HDEL', marks, plan.hdel)
  for _, pair in ipairs(plan.hset) do redis.call('HSET', marks, pair[1], pair[2]) end
  zdelay_t_each('ZREM', tagged, plan.zrem)
end

-- Writes the counts of *plan* (from zdelay_refs_plan in _guard.lua); a
-- template whose count reaches 0 is deleted with it, unless *keep* names it
-- (this call parks entries that use it).
local function zdelay_refs_apply(templates, plan, keep)
  for _, item in ipairs(plan) do
    local tid, count = item[1], item[2]
    if count > 0 or (keep and keep[tid]) then
      redis.call('HSET', templates, '#' .. tid, math.max(count, 1))
    else
      redis.call('HDEL', templates, tid, '#' .. tid)
    end
  end
end

-- Park: *entries* are {id, due ms, score, leased, held set or nil}, and
-- payload(e) the payload of the e-th (made as it is written: a bulk park
-- holds one copy at a time); an id parked again leaves the lease (leased
-- true) or the held set it is in, and its payload is replaced. *created*:
-- {template id, record} stored with the entries (HSETNX: ids are content
-- hashes); *forget*: the marks plan of the ids parked again (their key and
-- tags leave as cancelled); *refs*, *keep*: the template counts
-- (zdelay_refs_apply).
local function zdelay_t_park(s, entries, payload, created, forget, refs, keep)
  for _, item in ipairs(created) do redis.call('HSETNX', s.templates, item[1], item[2]) end
  zdelay_marks_apply(s.marks, s.tagged, forget)
  for e, entry in ipairs(entries) do
    local id = entry[1]
    if entry[4] then
      redis.call('ZREM', s.lease, id)
      redis.call('HDEL', s.leased, id)
    end
    if entry[5] then redis.call('ZREM', entry[5], id) end
    redis.call('ZADD', s.due, entry[3], id)  -- replaces the score of an id parked before
    redis.call('HSET', s.msg, id, payload(e))
  end
  zdelay_refs_apply(s.templates, refs, keep)
  zdelay_h_parked(entries)
end

-- The index of a parked entry: its record "i:<id>" (false: none), the key
-- it holds ('': none) and its tags. *revived*: the entry comes back from
-- the dead letters, whose record "d:<id>" it takes back.
local function zdelay_t_index(s, id, record, key, tags, revived)
  if revived then redis.call('HDEL', s.marks, 'd:' .. id) end
  if record then redis.call('HSET', s.marks, 'i:' .. id, record) end
  if key ~= '' then redis.call('HSET', s.marks, 'k:' .. key, id) end
  for _, tag in ipairs(tags) do redis.call('ZADD', s.tagged, 0, tag .. '\n' .. id) end
end

-- Due (or held) -> taken: the *n* lowest-ranked entries of *from* leave it
-- (the caller read them, in this script); each is then released, leased or
-- dead-lettered by the transitions below, in the same script.
local function zdelay_t_take(from, n)
  if n > 0 then redis.call('ZREMRANGEBYRANK', from, 0, n - 1) end
end

-- Taken -> in flight: *entries* {id, due score} leased to claim *token*
-- until *expiry* ms.
local function zdelay_t_lease(s, entries, token, expiry)
  for _, entry in ipairs(entries) do
    redis.call('ZADD', s.lease, expiry, entry[1])
    redis.call('HSET', s.leased, entry[1], zdelay_leased_value(entry[2], token))
  end
end

-- Due or held -> in flight: the *entries* {id, due score} are the lowest
-- ranks of *from* (the due set, or a held set when a control releases it).
local function zdelay_t_claim(s, from, entries, token, expiry)
  zdelay_t_take(from, #entries)
  zdelay_t_lease(s, entries, token, expiry)
end

-- In flight -> due, given back (the broker did not accept them): *entries*
-- {id, due score}, due again at their own score.
local function zdelay_t_unclaim(s, entries)
  for _, entry in ipairs(entries) do
    redis.call('ZADD', s.due, entry[2], entry[1])
    redis.call('ZREM', s.lease, entry[1])
    redis.call('HDEL', s.leased, entry[1])
  end
end

-- In flight -> due, the lease expired: *ids* are the lowest ranks of the
-- lease, *scores* their due scores.
local function zdelay_t_recover(s, ids, scores)
  for j, id in ipairs(ids) do
    redis.call('ZADD', s.due, scores[j], id)
    redis.call('HDEL', s.leased, id)
  end
  zdelay_t_take(s.lease, #ids)
end

-- In flight -> held: *entries* {id, due score} into *held*, the held set
-- of control *lane*, named in the lanes set in the same step.
local function zdelay_t_hold(s, held, lane, entries)
  if #entries == 0 then return end
  redis.call('SADD', s.lanes, lane)
  for _, entry in ipairs(entries) do
    redis.call('ZADD', held, entry[2], entry[1])
    redis.call('ZREM', s.lease, entry[1])
    redis.call('HDEL', s.leased, entry[1])
  end
  zdelay_h_held(lane, entries)
end

-- In flight (*leased* true) or taken -> gone: published. Their payloads go,
-- their templates' counts drop (*refs*, *keep*: see zdelay_refs_apply) and
-- their marks leave as *marks* plans ("release": an until_finished key
-- stays taken by its run). *scores*: their due scores, for the history
-- (optional: read from the leased hash when they are leased).
local function zdelay_t_release(s, ids, leased, refs, keep, marks, scores)
  zdelay_h_released(ids, scores, leased and s.leased)
  if leased then
    zdelay_t_each('ZREM', s.lease, ids)
    zdelay_t_each('HDEL', s.leased, ids)
  end
  zdelay_t_each('HDEL', s.msg, ids)
  if refs then zdelay_refs_apply(s.templates, refs, keep) end
  zdelay_marks_apply(s.marks, s.tagged, marks)
end

-- Due, held or in flight -> gone: cancelled, replaced or withdrawn.
-- *entries* are {id, the set it leaves: due, a held set, or the lease};
-- *refs* (optional) the template counts, *marks* the plan ("cancel").
local function zdelay_t_cancel(s, entries, refs, marks)
  for _, entry in ipairs(entries) do
    local id, from = entry[1], entry[2]
    redis.call('ZREM', from, id)
    if from == s.lease then redis.call('HDEL', s.leased, id) end
    redis.call('HDEL', s.msg, id)
  end
  if refs then zdelay_refs_apply(s.templates, refs) end
  zdelay_marks_apply(s.marks, s.tagged, marks)
  zdelay_h_cancelled(entries)
end

-- In flight (*leased* true) or taken -> dead: *entries* {id, reason JSON,
-- payload}, dead-lettered at *now_ms*; *marks* the plan ("dead": the record
-- is kept as "d:<id>" for a requeue). Templates keep their counts: a dead
-- letter still refers to its template.
local function zdelay_t_bury(s, entries, leased, now_ms, marks)
  zdelay_marks_apply(s.marks, s.tagged, marks)
  for _, entry in ipairs(entries) do
    local id = entry[1]
    redis.call('HSET', s.dead_msg, id, entry[2] .. '\n' .. (entry[3] or ''))
    redis.call('ZADD', s.dead, now_ms, id)
    if leased then
      redis.call('ZREM', s.lease, id)
      redis.call('HDEL', s.leased, id)
    end
    redis.call('HDEL', s.msg, id)
  end
  zdelay_h_dead(entries)
end

-- Dead -> due: *entries* {id, payload}, due at *score*; *restore* the
-- index records {id, record, key, tags} they take back (zdelay_t_index).
local function zdelay_t_requeue(s, entries, restore, score)
  for _, item in ipairs(restore) do zdelay_t_index(s, item[1], item[2], item[3], item[4], true) end
  for _, entry in ipairs(entries) do
    redis.call('HSET', s.msg, entry[1], entry[2])
    redis.call('ZADD', s.due, score, entry[1])
    redis.call('ZREM', s.dead, entry[1])
    redis.call('HDEL', s.dead_msg, entry[1])
  end
  zdelay_h_simple('Q', zdelay_h_ids(entries))
end

-- Dead -> gone: *ids* deleted for good with their kept marks ("d:<id>",
-- when *marked*) and template counts (*refs*). Returns how many the dead
-- zset held.
local function zdelay_t_purge(s, ids, refs, marked)
  zdelay_h_purged(s.dead, ids)
  redis.call('HDEL', s.dead_msg, unpack(ids))
  local removed = redis.call('ZREM', s.dead, unpack(ids))
  zdelay_refs_apply(s.templates, refs)
  if marked then
    local fields = {}
    for j, id in ipairs(ids) do fields[j] = 'd:' .. id end
    zdelay_t_each('HDEL', s.marks, fields)
  end
  return removed
end

-- A control's held set, found empty, no longer named in the lanes set (the
-- count read in the same script: an entry held meanwhile is never left in
-- a set no companion looks at).
local function zdelay_t_forget_lane(s, lane)
  redis.call('SREM', s.lanes, lane)
end

-- Due or held -> due at *score*: a held entry goes back into the due set in
-- the same step that takes it out of its held set (never in two places).
local function zdelay_t_reschedule(s, id, from, score)
  redis.call('ZREM', from, id)
  redis.call('ZADD', s.due, score, id)
  zdelay_h_simple('S', {id}, string.format('%.0f', math.floor(score / 1024)))
end

-- Key *field* of the marks hash ("k:<key>", or "b:<key>" for the one run
-- waiting for it) taken as *value* ("<id>\n<until ms>": a run's end at the latest).
local function zdelay_t_key_take(marks, field, value)
  redis.call('HSET', marks, field, value)
end

-- Key *field* of the marks hash freed: its run ended, or its owner was forged.
local function zdelay_t_key_free(marks, field)
  redis.call('HDEL', marks, field)
end
