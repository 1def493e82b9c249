-- Loaded in front of every script that includes _transitions.lua (see
-- scripts.py): the history of each task id ("did it fire, when, and who
-- cancelled it?", celery_zdelay/store/history.py reads it). The transitions call
-- zdelay_h_record, so every path that moves an entry records in one place.
--
-- Asked for by the caller, per call: it appends to KEYS the shard's
-- history hash, and to ARGV one string
--   "\0zdelay-history\0<how>\0<by>"
-- (how: plain, keyed or bulk for a park; id, tag, matching or withdrawn
-- for a cancel; by: who, as the caller says). They are taken off here, before the
-- script's body reads KEYS and ARGV, so no script lays out its arguments
-- differently for it. Without them (zdelay_history_seconds = 0) nothing is
-- recorded and no key is touched: one string comparison per call. Task ids
-- cannot start with a NUL byte (celery_zdelay/names.py); the scripts' other
-- last arguments are JSON (payloads, reasons, envelopes), digits (counts,
-- tokens) or a queue list key, none of which starts with that NUL-framed word.
--
-- history hash  id -> its events, oldest first, one line each,
--               "<code>\t<at ms>[\t<field>...]" (see the functions below)
-- A record expires zdelay_history_seconds after its last line's time: a
-- read ignores it from then on, and history_sweep.lua deletes it, scanning
-- the hash in bounded steps. No expiry is written: a zset of expiries cost
-- more Redis time on the release path than everything else here together,
-- and 140 bytes per task (docs/performance.rst).
-- A record keeps its last ZDELAY_H_CAP events: a task rescheduled a million
-- times holds 50 lines.
local zdelay_h = nil
do
  local last = ARGV[#ARGV]
  if type(last) == 'string' and string.sub(last, 1, 16) == '\0zdelay-history\0' then
    table.remove(ARGV)
    local hist = table.remove(KEYS)
    local fields, start = {}, 17
    while true do
      local nul = string.find(last, '\0', start, true)
      if not nul then fields[#fields + 1] = string.sub(last, start); break end
      fields[#fields + 1] = string.sub(last, start, nul - 1)
      start = nul + 1
    end
    -- Before any write: a key of another type fails the call here, by a
    -- read that checks the type as it reads (not TYPE and a comparison);
    -- the check of _guard.lua only says the fix.
    if not pcall(function() return redis.call('HLEN', hist) end) then
      zdelay_expect(hist, 'hash')
    end
    -- TIME before any write (Redis 6.2 replicates a script that reads the
    -- clock by its effects only when asked first).
    if redis.replicate_commands then redis.replicate_commands() end
    zdelay_h = {hist = hist, how = fields[1] or '', by = fields[2] or '', now = zdelay_now_ms()}
    zdelay_h.at = '\t' .. string.format('%.0f', zdelay_h.now)
  end
end

-- Events kept per id: the oldest go first.
local ZDELAY_H_CAP = 50
-- A line is at least 15 bytes (code, tab, 13 digits): a value shorter than
-- this never holds more than ZDELAY_H_CAP lines, and is never counted.
local ZDELAY_H_CAP_BYTES = 15 * ZDELAY_H_CAP

-- *value* with at most ZDELAY_H_CAP lines (the first ones dropped).
local function zdelay_h_capped(value)
  local _, newlines = string.gsub(value, '\n', '\n')
  local drop = newlines + 1 - ZDELAY_H_CAP
  local pos = 0
  while drop > 0 do
    pos = string.find(value, '\n', pos + 1, true)
    drop = drop - 1
  end
  return string.sub(value, pos + 1)
end

-- Event lines are "<code>\t<at ms>[\t<field>...]": code P parked, S
-- rescheduled, H held, R released, C cancelled, D dead-lettered, Q
-- requeued, X purged (celery_zdelay/store/history.py reads them). Each is
-- built by concatenation from zdelay_h.at (the tab and the call's time,
-- formatted once): the release path pays no string.format per task.

-- Appends lines[j] to the record of ids[j] for each j. Reads only the
-- history hash, whose type was checked when the call began, so it cannot
-- fail after a write. An id twice in *ids* gets both lines.
local function zdelay_h_record(ids, lines)
  if #ids == 0 then return end
  local values, order = {}, {}
  local hist = zdelay_h.hist
  for k = 1, #ids, 1000 do
    local last = math.min(k + 999, #ids)
    local fresh, asked = {}, {}
    for j = k, last do
      local id = ids[j]
      if values[id] == nil and not asked[id] then
        asked[id] = true
        fresh[#fresh + 1] = id
      end
    end
    if #fresh > 0 then
      local old = redis.call('HMGET', hist, unpack(fresh))
      for i = 1, #fresh do
        values[fresh[i]] = old[i] or false
        order[#order + 1] = fresh[i]
      end
    end
    for j = k, last do
      local id = ids[j]
      local old = values[id]
      if old then
        local value = old .. '\n' .. lines[j]
        if #value >= ZDELAY_H_CAP_BYTES then value = zdelay_h_capped(value) end
        values[id] = value
      else
        values[id] = lines[j]
      end
    end
  end
  for k = 1, #order, 500 do
    local fields, n = {}, 0
    for j = k, math.min(k + 499, #order) do
      local id = order[j]
      n = n + 2
      fields[n - 1], fields[n] = id, values[id]
    end
    redis.call('HSET', hist, unpack(fields))
  end
end

-- The ids of *entries* (tables whose first item is the id).
local function zdelay_h_ids(entries)
  local ids = {}
  for j = 1, #entries do ids[j] = entries[j][1] end
  return ids
end

-- The same *line* for each of *ids*.
local function zdelay_h_same(ids, line)
  local lines = {}
  for j = 1, #ids do lines[j] = line end
  zdelay_h_record(ids, lines)
end

-- Parked: *entries* {id, due ms, ...}; which call parked them (plain,
-- keyed, bulk) as the caller says.
local function zdelay_h_parked(entries)
  if not zdelay_h then return end
  local head, tail = 'P' .. zdelay_h.at .. '\t', '\t' .. zdelay_h.how
  local lines = {}
  for j = 1, #entries do lines[j] = head .. string.format('%.0f', entries[j][2]) .. tail end
  zdelay_h_record(zdelay_h_ids(entries), lines)
end

-- Released by the caller (a companion) at *scores* (due scores, by index of
-- *ids*), or, without them, at the due scores of the *leased* hash, read
-- before the transition deletes them. How late: ms after the due time, on
-- the Redis clock; negative for a release ahead (zdelay_release_ahead_seconds:
-- the releasing call's *how* is the most ms ahead it releases, and the
-- worker's ETA timer holds the task until due), else at least 0 (a release
-- a test fast-forwarded early).
local function zdelay_h_released(ids, scores, leased)
  if not zdelay_h or #ids == 0 then return end
  if not scores and leased then
    scores = {}
    for k = 1, #ids, 1000 do
      local values = redis.call('HMGET', leased, unpack(ids, k, math.min(k + 999, #ids)))
      for i = 1, #values do scores[k + i - 1] = zdelay_due_score(values[i]) or false end
    end
  end
  local head, now, floor, max = 'R' .. zdelay_h.at .. '\t' .. zdelay_h.by .. '\t', zdelay_h.now,
    math.floor, math.max
  local lines = {}
  local ahead = tonumber(zdelay_h.how)
  local least = ahead and ahead > 0 and -ahead or 0
  for j = 1, #ids do
    local score = scores and tonumber(scores[j])
    -- Small whole numbers: concatenation writes them without an exponent.
    lines[j] = score and (head .. max(least, now - floor(score / 1024))) or head
  end
  zdelay_h_record(ids, lines)
end

-- Cancelled: replaced by a keyed park (the call parks), or cancelled by id
-- or tag, or withdrawn, as the caller says; by whom, when given.
local function zdelay_h_cancelled(entries)
  if not zdelay_h then return end
  local how = zdelay_h.how
  if how == 'plain' or how == 'keyed' or how == 'bulk' then how = 'replaced' end
  zdelay_h_same(zdelay_h_ids(entries), 'C' .. zdelay_h.at .. '\t' .. how .. '\t' .. zdelay_h.by)
end

-- Held back by control *lane* (hold.lua): by a pause, a rate limit or a
-- concurrency control (store/control.py names a pause's lane
-- "pause|<control>", a concurrency control's "concurrency|<control>[ <limit key>]",
-- a key's limit "limit_key:<key>", and the lane of one limit key under a
-- pause or a queue's or task's limit "<that lane> <limit key>").
local function zdelay_h_held(lane, entries)
  if not zdelay_h then return end
  local reason, control = 'rate_limit', lane
  if string.sub(lane, 1, 12) == 'concurrency|' then
    reason, control = 'concurrency', string.match(string.sub(lane, 13), '^[^ ]*')
  elseif string.sub(lane, 1, 10) ~= 'limit_key:' then
    -- Control names hold no space: what follows one is a limit key.
    control = string.match(lane, '^[^ ]*')
    if string.sub(control, 1, 6) == 'pause|' then
      reason, control = 'pause', string.sub(control, 7)
    end
  end
  zdelay_h_same(zdelay_h_ids(entries), 'H' .. zdelay_h.at .. '\t' .. reason .. '\t' .. control)
end

-- Dead-lettered: *entries* {id, reason JSON (one line), ...}.
local function zdelay_h_dead(entries)
  if not zdelay_h then return end
  local head, lines = 'D' .. zdelay_h.at .. '\t', {}
  for j = 1, #entries do lines[j] = head .. entries[j][2] end
  zdelay_h_record(zdelay_h_ids(entries), lines)
end

-- An event with no field of its own (Q requeued, X purged), or one (S
-- rescheduled: its due ms as *field*), for each of *ids*.
local function zdelay_h_simple(code, ids, field)
  if not zdelay_h then return end
  local line = code .. zdelay_h.at
  if field then line = line .. '\t' .. field end
  zdelay_h_same(ids, line)
end

-- Purged: only the ids *dead* holds (read before the transition deletes them).
local function zdelay_h_purged(dead, ids)
  if not zdelay_h then return end
  local gone, seen = {}, {}
  for _, id in ipairs(ids) do
    if not seen[id] and redis.call('ZSCORE', dead, id) then gone[#gone + 1] = id end
    seen[id] = true
  end
  zdelay_h_simple('X', gone)
end
