-- Loaded in front of every script that includes _transitions.lua (see
-- scripts.py): the history of each task id ("did it fire, when, and who
-- cancelled it?", celery_zdelay/history.py reads it). The transitions call
-- zdelay_h_record, so every path that moves an entry records in one place.
--
-- Asked for by the caller, per call: it appends to KEYS the shard's
-- history hash and history_exp zset, and to ARGV one string
--   "\0zdelay-history\0<keep ms>\0<how>\0<by>"
-- (how: plain, keyed or bulk for a park, id, tag or withdrawn for a cancel;
-- by: who, as the caller says). They are taken off here, before the
-- script's body reads KEYS and ARGV, so no script lays out its arguments
-- differently for it. Without them (zdelay_history_seconds = 0) nothing is
-- recorded and no key is touched: one string comparison per call. Task ids
-- cannot start with a NUL byte (celery_zdelay/names.py), nor can the other
-- last arguments of the scripts (payloads, reasons and envelopes are JSON).
--
-- history hash      id -> its events, oldest first, one line each,
--                   "<code>\t<at ms>[\t<field>...]" (see zdelay_h_line)
-- history_exp zset  id -> ms after which its record is expired: read as
--                   gone, and deleted by history_sweep.lua in bounded steps
-- A record keeps its last ZDELAY_H_CAP events: a task rescheduled a million
-- times holds 50 lines.
local zdelay_h = nil
do
  local last = ARGV[#ARGV]
  if type(last) == 'string' and string.sub(last, 1, 16) == '\0zdelay-history\0' then
    table.remove(ARGV)
    local exp, hist = table.remove(KEYS), table.remove(KEYS)
    local fields, start = {}, 17
    while true do
      local nul = string.find(last, '\0', start, true)
      if not nul then fields[#fields + 1] = string.sub(last, start); break end
      fields[#fields + 1] = string.sub(last, start, nul - 1)
      start = nul + 1
    end
    local keep_ms = zdelay_number(fields[1])
    if not keep_ms or keep_ms <= 0 then
      error({err = 'ERR celery-zdelay history: the keep time is not a positive number'})
    end
    -- Before any write: a key of another type fails the call here. Two
    -- reads that check the types as they read (not TYPE and a comparison
    -- each); the checks of _guard.lua only say the fix.
    local typed = pcall(function()
      redis.call('HLEN', hist)
      redis.call('ZCARD', exp)
    end)
    if not typed then zdelay_expect(hist, 'hash', exp, 'zset') end
    -- TIME before any write (Redis 6.2 replicates a script that reads the
    -- clock by its effects only when asked first).
    if redis.replicate_commands then redis.replicate_commands() end
    zdelay_h = {hist = hist, exp = exp, keep_ms = keep_ms, how = fields[2] or '',
      by = fields[3] or '', now = zdelay_now_ms()}
  end
end

-- Events kept per id: the oldest go first.
local ZDELAY_H_CAP = 50

-- *value* with at most ZDELAY_H_CAP lines (the first ones dropped). A line
-- is at least 15 bytes (code, tab, 13 digits), so a value shorter than
-- 15 * cap bytes is never counted.
local function zdelay_h_capped(value)
  if #value < 15 * ZDELAY_H_CAP then return value end
  local _, newlines = string.gsub(value, '\n', '\n')
  local drop = newlines + 1 - ZDELAY_H_CAP
  local pos = 0
  while drop > 0 do
    pos = string.find(value, '\n', pos + 1, true)
    drop = drop - 1
  end
  return string.sub(value, pos + 1)
end

-- One event line: *code* (P parked, S rescheduled, H held, R released,
-- C cancelled, D dead-lettered, Q requeued, X purged), when, and its fields.
local function zdelay_h_line(code, ...)
  local line = code .. '\t' .. string.format('%.0f', zdelay_h.now)
  for _, field in ipairs({...}) do line = line .. '\t' .. field end
  return line
end

-- Appends line(j) to the record of ids[j] for each j, and keeps the records
-- for zdelay_h.keep_ms from now. Reads only the history hash, whose type
-- was checked when the call began, so it cannot fail after a write. An id
-- twice in *ids* gets both lines.
local function zdelay_h_record(ids, line)
  if not zdelay_h or #ids == 0 then return end
  local values, order = {}, {}
  for k = 1, #ids, 1000 do
    local last = math.min(k + 999, #ids)
    local fresh = {}
    for j = k, last do
      if values[ids[j]] == nil and not fresh[ids[j]] then
        fresh[ids[j]] = true
        fresh[#fresh + 1] = ids[j]
      end
    end
    if #fresh > 0 then
      local old = redis.call('HMGET', zdelay_h.hist, unpack(fresh))
      for i, id in ipairs(fresh) do
        values[id] = old[i] or false
        order[#order + 1] = id
      end
    end
    for j = k, last do
      local id, old = ids[j], values[ids[j]]
      values[id] = old and zdelay_h_capped(old .. '\n' .. line(j)) or line(j)
    end
  end
  local expiry = zdelay_h.now + zdelay_h.keep_ms
  for k = 1, #order, 500 do
    local fields, members = {}, {}
    for j = k, math.min(k + 499, #order) do
      local id = order[j]
      fields[#fields + 1] = id
      fields[#fields + 1] = values[id]
      members[#members + 1] = expiry
      members[#members + 1] = id
    end
    redis.call('HSET', zdelay_h.hist, unpack(fields))
    redis.call('ZADD', zdelay_h.exp, unpack(members))
  end
end

-- The ids of *entries* (tables whose first item is the id).
local function zdelay_h_ids(entries)
  local ids = {}
  for j, entry in ipairs(entries) do ids[j] = entry[1] end
  return ids
end

-- Parked: *entries* {id, due ms, ...}; which call parked them (plain,
-- keyed, bulk) as the caller says.
local function zdelay_h_parked(entries)
  if not zdelay_h then return end
  zdelay_h_record(zdelay_h_ids(entries), function(j)
    return zdelay_h_line('P', string.format('%.0f', entries[j][2]), zdelay_h.how)
  end)
end

-- Released by the caller (a companion) at *scores* (due scores, by index of
-- *ids*), or, without them, at the due scores of the *leased* hash, read
-- before the transition deletes them. How late: ms after the due time, on
-- the Redis clock (0 for a release a test fast-forwarded early).
local function zdelay_h_released(ids, scores, leased)
  if not zdelay_h or #ids == 0 then return end
  if not scores and leased then
    scores = {}
    for k = 1, #ids, 1000 do
      local values = redis.call('HMGET', leased, unpack(ids, k, math.min(k + 999, #ids)))
      for i, value in ipairs(values) do scores[k + i - 1] = zdelay_due_score(value) end
    end
  end
  zdelay_h_record(ids, function(j)
    local score = scores and tonumber(scores[j])
    local late = score and math.max(0, zdelay_h.now - math.floor(score / 1024)) or ''
    return zdelay_h_line('R', zdelay_h.by, type(late) == 'number' and string.format('%.0f', late) or '')
  end)
end

-- Cancelled: replaced by a keyed park (the call parks), or cancelled by id
-- or tag, or withdrawn, as the caller says; by whom, when given.
local function zdelay_h_cancelled(entries)
  if not zdelay_h then return end
  local how = zdelay_h.how
  if how == 'plain' or how == 'keyed' or how == 'bulk' then how = 'replaced' end
  zdelay_h_record(zdelay_h_ids(entries), function()
    return zdelay_h_line('C', how, zdelay_h.by)
  end)
end

-- Held back by control *lane* (hold.lua): by a pause or a rate limit
-- (store/control.py names a pause's lane "pause|<control>").
local function zdelay_h_held(lane, entries)
  if not zdelay_h then return end
  local reason, control = 'rate_limit', lane
  if string.sub(lane, 1, 6) == 'pause|' then reason, control = 'pause', string.sub(lane, 7) end
  zdelay_h_record(zdelay_h_ids(entries), function()
    return zdelay_h_line('H', reason, control)
  end)
end

-- Dead-lettered: *entries* {id, reason JSON (one line), ...}.
local function zdelay_h_dead(entries)
  if not zdelay_h then return end
  zdelay_h_record(zdelay_h_ids(entries), function(j)
    return zdelay_h_line('D', entries[j][2])
  end)
end

-- An event with no field of its own (Q requeued, S rescheduled with its due
-- ms as *field*, X purged) for each of *ids*.
local function zdelay_h_simple(code, ids, field)
  if not zdelay_h then return end
  zdelay_h_record(ids, function()
    if field then return zdelay_h_line(code, field) end
    return zdelay_h_line(code)
  end)
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
