-- Store periodic task definitions: a companion's beat_schedule, or one entry.
--
-- KEYS[1] defs hash        name -> definition JSON
-- KEYS[2] versions hash    name -> version (only grows, also across removals)
-- KEYS[3] pointers hash    name -> {"v": version, "ms": newest occurrence parked
--                          (or the anchor), "ids": [[ms, id], ...] parked lately,
--                          "incl": true when "ms" is itself an occurrence still to run}
-- KEYS[4] paused set       names
-- KEYS[5] cancel set       occurrence ids every companion cancels (then forgets)
-- KEYS[6] meta hash        hash, written_by, written_ms, made, reading, unserved,
--                          base of the stored configuration; gen (see "A
--                          configuration as its changes" below)
-- KEYS[7] superseded set   configuration hashes replaced by a newer one
-- KEYS[8] visits zset      name -> ms a planner pass looks at it from (see _pointer.lua)
-- KEYS[9..] the shards' keys, five per shard (see _withdraw.lua); none on a
--           Redis Cluster, whose shards are other slots
-- ARGV[1] mode             "config": replace the entries from configuration
--                          "diff": store a configuration as its changes from the
--                          stored one (see "A configuration as its changes" below)
--                          "put": add or replace one entry; "drop": remove ARGV[7..]
-- ARGV[2] configuration hash ("config"/"diff" mode)
-- ARGV[3] "1": write even a superseded configuration (a deliberate rollback)
-- ARGV[4] writer (companion id)
-- ARGV[5] "config"/"diff": when the source made this configuration, an integer
--         (django-celery-beat's change marker, epoch microseconds), or ""
--         for none (a beat_schedule: ordered by the superseded set instead)
-- ARGV[6] "config"/"diff" with ARGV[5]: how this release reads the source, an
--         integer (django_beat.ROWS_READING); "" elsewhere
-- ARGV[7..] "config"/"put": triples name, definition JSON, since ms ("" for
--           none: a new entry starts from now; else from that time, e.g.
--           celery beat's last run of it, so the missed policy covers the
--           switch; "=<ms>": from that time whether new or changed, e.g. a
--           clocked row edited to a moment already past); "drop": names
--           ("config": an entry that cannot be served has no definition and
--           the reason in the third place: "" keeps what is stored under
--           that name, e.g. its task module does not import here; "!"
--           withdraws it, e.g. a database row every companion reads as bad.
--           The reasons are stored as the meta field "unserved", JSON)
-- ARGV[7] "diff": the hash of the configuration the changes were made
--         against; ARGV[8..] triples as in "config" mode, all those of each
--         name whose definition or reason differs from that configuration's,
--         and each name it named and this one does not, with "-" in the
--         second place
-- returns {status, kind, name, kind, name, ...}: status "same" (configuration
--         already stored), "older" (superseded, or made before the stored
--         one: not written), "stale" ("diff": the stored configuration is
--         not the one the changes were made against, or was changed since;
--         nothing written, the caller stores it in "config" mode), "done";
--         each kind "new", "changed", "relabelled"
--         or "removed", or "withdrawn" with an occurrence's id in place of
--         the name: one this script took back from a due set, which never
--         runs (the caller records it as cancelled; one taken from a lease
--         may be on its way to the broker, and is not named)
--
-- Two rules order configurations. A beat_schedule has no time of its own:
-- the newest deploy wins, and a fingerprint replaced once is refused for
-- ever (a companion of the previous release, restarted, must not roll the
-- schedule back). Rows edited in the Django admin do have one, and a row
-- edited back to what it was is a new edit, not a rollback: a configuration
-- made at a time (ARGV[5]) is refused only when it was made no later than
-- the stored one (a companion that read the rows before another read them
-- after an edit), whatever it contains. The stored time is kept as the
-- meta field "made", also when the content is the same.
--
-- Rows read at the same time are not stored over each other, with one
-- exception: a later release that reads them otherwise (ARGV[6] above the
-- stored reading: a new field of the definitions) stores its reading over
-- an earlier one's, so an upgrade shows without an edit, and an earlier
-- release is refused at that time as before. The stored reading is kept
-- as the meta field "reading", "<n> <hash>": a configuration written by a
-- release that does not write it (another hash) was read as 1.
--
-- A change or removal takes the old version's occurrences back from the
-- shards in this same script (_withdraw.lua): once it returns, no companion
-- can release one of them, so no tick runs under two versions.
--
-- A definition that differs from the stored one only in how it is shown and
-- who owns it (LABELS: its display name, its source) is no change of the
-- schedule: it is "relabelled", stored over the old one with its version,
-- pointer and parked occurrences as they are (a new version would start
-- an interval's phase again from now). So an upgrade that stores
-- django-celery-beat rows under their admin names and their own source,
-- where the release before stored them as "config", neither withdraws nor
-- delays a tick.
--
-- A configuration as its changes ("diff" mode): storing one whole costs
-- Redis its every entry (100,000 django-celery-beat rows: the triples
-- parsed, an HGETALL, a comparison each) however few changed. Sent as its
-- changes from the configuration the caller stored or saw stored last, it
-- costs what changed, and it stores exactly what "config" mode would: the
-- names it does not send hold what that configuration holds, so "config"
-- mode would leave them as they are (a hash is of the names, definitions
-- and reasons: the same hash, the same configuration). That holds while the
-- defs hash is as that configuration's write left it (entries added at run
-- time aside), so
-- the guard is the meta field "base", "<gen> <count>", written with every
-- configuration: the meta field "gen" then (a counter every write of a
-- definition bumps, in every mode) and how many definitions were stored.
-- A "diff" is refused ("stale") unless the stored hash is ARGV[7] and "base"
-- is the "gen" and the HLEN of the defs hash now; "same" and "older" are
-- answered first, as "config" mode answers them whatever is stored.
-- Releases before this one do not bump "gen". Their "config" write stores a
-- configuration whole, with its own hash: a "diff" against that hash finds
-- the defs hash as that write left it, whatever "base" says (a count it
-- moved refuses the diff: the configuration goes whole). Their "drop"
-- (periodic remove) and their "put" of a new name (periodic add) change the
-- count. What none of the three checks sees is their "put" replacing a
-- stored name (or a "drop" and a "put" of a new name in between, which
-- leave the count): a configured entry replaced or removed at run time then
-- stays so until its name changes in the configuration or one is stored
-- whole, where "config" mode would put it back at this store. Nothing runs
-- twice or under two versions either way (their put and drop take the old
-- version's occurrences back in their own script), and nothing this diff
-- names is stored otherwise than "config" mode stores it.
--
-- Everything that can fail is checked before the first write (key types,
-- version counters, template counts): a failure leaves every schedule as it was.
if redis.replicate_commands then redis.replicate_commands() end

local defs, versions, pointers, paused, cancel, meta, superseded, visits =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local mode = ARGV[1]
zdelay_expect(defs, 'hash', versions, 'hash', pointers, 'hash', paused, 'set', cancel, 'set',
  meta, 'hash', superseded, 'set', visits, 'zset')
local shards = periodic_shards(9)
local now_ms = zdelay_now_ms()

-- 1. Decide (reads only): which names are new, changed, relabelled or removed.
local LABELS = {display_name = true, source = true}
-- Whether two decoded JSON values are equal, leaving out the keys in *skip*
-- of the outer object.
local function same_json(a, b, skip)
  if type(a) ~= 'table' or type(b) ~= 'table' then return a == b end
  for k, v in pairs(a) do
    if not (skip and skip[k]) and not same_json(v, b[k]) then return false end
  end
  for k in pairs(b) do
    if not (skip and skip[k]) and a[k] == nil then return false end
  end
  return true
end
local function only_labels_differ(stored, body)
  local ok_a, a = pcall(cjson.decode, stored)
  local ok_b, b = pcall(cjson.decode, body)
  return ok_a and ok_b and type(a) == 'table' and type(b) == 'table' and same_json(a, b, LABELS)
end
local puts, relabels, drops = {}, {}, {}
-- name -> why, of the configuration's entries not served ("config"/"diff").
local unserved = {}
-- name -> stored body, when every definition was read at once ("config"
-- mode): one HGETALL rather than an HGET per entry.
local bodies = nil
local function want_put(name, body, since)
  local stored
  if bodies then stored = bodies[name] or false else stored = redis.call('HGET', defs, name) end
  if stored == body then return end
  if stored and only_labels_differ(stored, body) then
    relabels[#relabels + 1] = {name, body}
    return
  end
  zdelay_expect_field_counter(versions, name)
  puts[#puts + 1] = {name, body, since, stored and 'changed' or 'new'}
end
local function want_drop(name)
  if redis.call('HEXISTS', defs, name) == 1 then drops[#drops + 1] = name end
end
-- Whether a stored body is the configuration's: all but those added at run
-- time (source "api"), and one stored without a source, read as "config".
-- One that cannot be read is left where it is.
local function configured(body)
  local ok, d = pcall(cjson.decode, body)
  return ok and type(d) == 'table' and d.source ~= 'api'
end

local hash = ARGV[2]
local current = redis.call('HGET', meta, 'hash')
if mode == 'drop' then
  for i = 7, #ARGV do want_drop(ARGV[i]) end
elseif mode == 'put' then
  want_put(ARGV[7], ARGV[8], ARGV[9])
else
  -- "config", "diff": the newest configuration wins (see the header).
  local made = tonumber(ARGV[5])
  local reading = tonumber(ARGV[6]) or 1
  local stored_made = tonumber(redis.call('HGET', meta, 'made') or '')
  if current == hash then
    if made and (not stored_made or made > stored_made) then
      redis.call('HSET', meta, 'made', ARGV[5])
    end
    return {'same'}
  end
  if ARGV[3] ~= '1' then
    if made then
      local stored_reading = 1
      local n, of = string.match(redis.call('HGET', meta, 'reading') or '', '^(%d+) (.*)$')
      if n and of == current then stored_reading = tonumber(n) end
      if stored_made and (made < stored_made
          or (made == stored_made and reading <= stored_reading)) then
        return {'older', current or ''}
      end
    elseif redis.call('SISMEMBER', superseded, hash) == 1 then
      return {'older', current or ''}
    end
  end
  if mode == 'diff' then
    -- The stored configuration is the one the changes were made against,
    -- as its write left it (see "A configuration as its changes").
    local base, gen = redis.call('HGET', meta, 'base'), redis.call('HGET', meta, 'gen')
    if current ~= ARGV[7] or not gen or base ~= gen .. ' ' .. redis.call('HLEN', defs) then
      return {'stale', current or ''}
    end
    local ok, was = pcall(cjson.decode, redis.call('HGET', meta, 'unserved') or '{}')
    if not ok or type(was) ~= 'table' then return {'stale', current or ''} end
    unserved = was
    -- Each name sent comes with all its triples (a definition, a reason, or
    -- both): one sent without a definition or a kept reason is removed, as
    -- "config" mode removes one it does not name.
    local incoming, looked = {}, {}
    for i = 8, #ARGV, 3 do
      if ARGV[i + 1] ~= '!' and ARGV[i + 1] ~= '-' then incoming[ARGV[i]] = true end
    end
    for i = 8, #ARGV, 3 do
      local name, body = ARGV[i], ARGV[i + 1]
      if not incoming[name] and not looked[name] then
        looked[name] = true
        local stored = redis.call('HGET', defs, name)
        if stored and configured(stored) then drops[#drops + 1] = name end
      end
      if body ~= '' and body ~= '!' and body ~= '-' then want_put(name, body, ARGV[i + 2]) end
      unserved[name] = nil
    end
  else
    local incoming = {}
    for i = 7, #ARGV, 3 do
      if ARGV[i + 1] ~= '!' then incoming[ARGV[i]] = true end
    end
    -- Every definition but those added at run time is the configuration's:
    -- beat_schedule entries, django-celery-beat rows. One it no longer
    -- names is removed.
    local stored = redis.call('HGETALL', defs)
    bodies = {}
    for i = 1, #stored, 2 do
      bodies[stored[i]] = stored[i + 1]
      if not incoming[stored[i]] and configured(stored[i + 1]) then want_drop(stored[i]) end
    end
    for i = 7, #ARGV, 3 do
      if ARGV[i + 1] ~= '' and ARGV[i + 1] ~= '!' then want_put(ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
    end
  end
  for i = mode == 'diff' and 8 or 7, #ARGV, 3 do
    if ARGV[i + 1] == '' or ARGV[i + 1] == '!' then unserved[ARGV[i]] = ARGV[i + 2] end
  end
end
-- Bumped by each write of a definition (see "A configuration as its changes").
local writes = mode == 'config' or mode == 'diff' or #puts + #drops + #relabels > 0
if writes then zdelay_expect_field_counter(meta, 'gen') end

-- 2. What the old versions still have parked or leased: taken back below.
local listed = {}   -- name -> {{ms, id}, ...}
local ids, seen = {}, {}
local function gather(name)
  local ahead, due = periodic_parked(periodic_pointer(pointers, name), now_ms)
  listed[name] = due
  for _, list in ipairs({ahead, due}) do
    for _, pair in ipairs(list) do
      if not seen[pair[2]] then
        seen[pair[2]] = true
        ids[#ids + 1] = pair[2]
      end
    end
  end
end
for _, p in ipairs(puts) do gather(p[1]) end
for _, name in ipairs(drops) do gather(name) end
local withdraw = periodic_withdraw_plan(shards, ids)

-- 3. Write.
local taken = {}
if #shards > 0 then
  taken = periodic_withdraw_apply(withdraw)
  -- Held back by a pause or a rate limit, they would run at the resume.
  for _, id in ipairs(periodic_withdraw_rest(withdraw, ids)) do redis.call('SADD', cancel, id) end
else
  -- A cluster: every companion (and the caller, before it returns) cancels these.
  for _, id in ipairs(ids) do redis.call('SADD', cancel, id) end
end

local changed = {}
for _, name in ipairs(drops) do
  redis.call('HDEL', defs, name)
  redis.call('HDEL', pointers, name)
  redis.call('SREM', paused, name)
  redis.call('ZREM', visits, name)
  changed[#changed + 1] = 'removed'
  changed[#changed + 1] = name
end
for _, p in ipairs(puts) do
  local name, body, since, kind = p[1], p[2], p[3], p[4]
  local version = redis.call('HINCRBY', versions, name, 1)
  local record = {v = version, ms = now_ms, ids = {}}
  -- A tick that was due and still waiting in the due set (taken back
  -- above) runs under the new version: the schedule goes on from it,
  -- inclusive. One leased to a companion is in flight under the old one.
  local first_due = nil
  for _, pair in ipairs(listed[name]) do
    if taken[pair[2]] == 'due' and type(pair[1]) == 'number'
        and (not first_due or pair[1] < first_due) then
      first_due = pair[1]
    end
  end
  if first_due then
    record.ms, record.incl = first_due, true
  else
    local pinned = string.match(since, '^=(%-?%d+)$')
    local from = tonumber(pinned) or (kind == 'new' and tonumber(since))
    if from and from < now_ms then record.ms = from end
  end
  redis.call('HSET', defs, name, body)
  redis.call('HSET', pointers, name, cjson.encode(record))
  -- Looked at from the new pointer on (no id parked yet); a paused one
  -- stays out of the visits until its resume.
  if redis.call('SISMEMBER', paused, name) == 0 then
    redis.call('ZADD', visits, periodic_next_visit(record, nil, name), name)
  end
  changed[#changed + 1] = kind
  changed[#changed + 1] = name
end
for _, r in ipairs(relabels) do
  redis.call('HSET', defs, r[1], r[2])
  changed[#changed + 1] = 'relabelled'
  changed[#changed + 1] = r[1]
end
local gen = writes and redis.call('HINCRBY', meta, 'gen', 1)
if mode == 'config' or mode == 'diff' then
  if current then redis.call('SADD', superseded, current) end
  redis.call('SREM', superseded, hash)
  redis.call('HSET', meta, 'hash', hash, 'written_by', ARGV[4], 'written_ms', now_ms,
    'unserved', next(unserved) and cjson.encode(unserved) or '{}',
    'base', gen .. ' ' .. redis.call('HLEN', defs))
  if tonumber(ARGV[5]) then
    redis.call('HSET', meta, 'made', ARGV[5], 'reading', (tonumber(ARGV[6]) or 1) .. ' ' .. hash)
  end
end
for _, id in ipairs(ids) do
  if taken[id] == 'due' then
    changed[#changed + 1] = 'withdrawn'
    changed[#changed + 1] = id
  end
end
-- Not {'done', unpack(changed)}: unpack stops at Lua's C stack (about 8,000
-- values), and a beat_schedule of 4,000 entries changes that many.
table.insert(changed, 1, 'done')
return changed
