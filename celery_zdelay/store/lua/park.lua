-- Park task messages until they are due, replacing any entry with the same id.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] msg hash      id -> payload
-- KEYS[3] lease zset    id -> lease expiry ms (entries being released)
-- KEYS[4] leased hash   id -> "<due score> <claim token>"
-- KEYS[5] dests set     kombu list keys named by parked entries (for handoff)
-- KEYS[6] call marker   unique to this park call; makes a retried call a no-op
-- KEYS[7] templates     template id -> template record (see entry.py), and
--                       "#" id -> how many entries refer to it (_guard.lua)
-- KEYS[8] lanes set     names of the controls with a held set on this shard
-- KEYS[9] marks hash    keys and tags of entries (see _marks.lua)
-- KEYS[10] tagged zset  entries by tag (see _marks.lua)
-- KEYS[11..] held zsets one per control name of ARGV[5..], in that order
--           (those the caller knows; none at first)
-- then eight per other shard of the same batch on this Redis server (its
--           keys 1-5 and 7, marks, tagged): checked too, so that a batch one shard cannot
--           take fails in every shard's call before any of them writes (a
--           MULTI/EXEC does not undo the calls that ran before a failing one)
-- ARGV[1] wake channel, published to when the earliest due time moves earlier
--         (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2] ms the call marker lives (longer than the caller's retries take)
-- ARGV[3] number of templates
-- ARGV[4] number of held sets given (KEYS[11..]), then their control names
-- then two per template: id, record (stored once; ids are content hashes)
-- then five per entry: id, mode, ms, payload, dest
--           mode "r": due ms after the Redis clock; "a": absolute epoch ms
--           dest "": no handoff destination
-- (zdelay_park_layout in _guard.lua reads these positions)
-- returns the due ms of each entry, in argument order; or {-2}, having
--         written nothing, when an id parked again is held back in a held
--         set not given (read the lanes set and call again)
--
-- Parking an id again replaces its entry wherever it waits: in the due set,
-- in the lease (being released), or in the held set of a pause or rate
-- limit (hold.lua), which it leaves in this script (an id is in one place).
-- Only an id whose payload is stored already is looked for (zdelay_where in
-- _where.lua): the first park of an id reads nothing more.
--
-- The entry parked again is a new one: the key and tags the id had (its
-- record "i:<id>" in the marks hash) leave the index in this script, as
-- park_keyed.lua forgets them before it runs this one with the new marks.
-- Also asked only for an id whose payload is stored already (one HEXISTS).
--
-- Each payload is stored with when it was parked on the Redis clock: "p":<ms>
-- spliced first into its metadata line ({"p":<ms>,"v":1,...}), replacing
-- one a re-parked payload carries. It is outside what a signature covers
-- (entry.py signs the envelope and its routing, never the metadata line). A
-- message stored whole (zdelay_whole_messages) has no such line.
if redis.replicate_commands then redis.replicate_commands() end

local due, msg, lease, leased, dests, marker, templates =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

local layout = zdelay_expect_park_args()
local marks, tagged = layout.marks, layout.tagged
local first_template, first_entry = layout.first_template, layout.first_entry
local now_ms = zdelay_now_ms()
local stamp = '{"p":' .. string.format('%.0f', now_ms) .. ','

-- *payload* with the parked-at stamp first in its metadata line. It costs
-- one copy of the payload (gsub builds one string; a concatenation of a
-- string.sub would make two). entry.py's payloads start '{"v":'; one read
-- back from the store starts '{"p":' and has its stamp replaced.
local byte, gsub = string.byte, string.gsub
local function stamped(payload)
  if byte(payload, 1) ~= 123 or byte(payload, 2) ~= 34 then return payload end  -- {"
  -- A message stored whole ({"body":...) has no metadata line: it is kept
  -- exactly as the handoff pushes it.
  if byte(payload, 3) == 98 then return payload end  -- b
  if byte(payload, 3) == 112 then  -- p
    local restamped, found = gsub(payload, '^{"p":%d+,', stamp)
    if found == 1 then return restamped end
  end
  return (gsub(payload, '^{', stamp))
end

-- Same-millisecond entries keep parking order: each takes the next of the
-- 1024 sequence slots of its millisecond (the last slot is shared once full).
-- The score is due_ms * 1024 + seq in every script; celery_zdelay/due_score.py
-- is where Python reads and writes the same encoding (change both together).
-- One read per millisecond answers two questions: the highest score up to
-- the millisecond's last slot is the last entry parked in it (when it is in
-- the millisecond), and whether anything at all is due earlier (the wake-up
-- below needs nothing else).
local last_seq, earlier = {}, {}
local function score_for(due_ms)
  local lo = due_ms * 1024
  local score = last_seq[due_ms]
  if score then
    score = score + 1
  else
    local top = redis.call('ZREVRANGEBYSCORE', due, lo + 1023, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local top_score = tonumber(top[2])
    earlier[due_ms] = top_score ~= nil
    if top_score and top_score >= lo then score = top_score + 1 else score = lo end
  end
  score = math.min(score, lo + 1023)
  last_seq[due_ms] = score
  return score
end

-- Everything is read before the first write, and those reads check the
-- types of the keys written after them (a read of a key of another type
-- fails as the check would): due (ZREVRANGEBYSCORE), msg (HGET), lease
-- (ZSCORE), templates (the HGET of a template's count, HEXISTS where it has
-- none, and the counts' HGET before any count is written), marks (HEXISTS,
-- then zdelay_marks_plan checks marks and tagged). leased is
-- checked when an entry being released needs it; dests is written first of
-- all (below). A failed read is reported as the checks of _guard.lua report
-- it, with the fix.
local created, delta, keep, holds = {}, {}, {}, {}
-- Held ids parked again: id -> the held set they leave. lanes_stale: one is
-- held in a set not given (the caller reads the lanes and calls again).
local place = {due = due, lease = lease, msg = msg, held = layout.held}
local unheld, lanes_stale, lanes_complete = {}, false, nil
local entries = {}
local refs
-- Ids parked again that carry marks, and the writes that forget them.
local forget, forgotten, forget_plan = {}, {}, nil
local lowest, wake  -- set by the first entry: its score, and whether nothing is due before it
-- Template counts read here, for zdelay_refs_plan (false: no count).
local counts = {}
local function read()
  for i = first_template, first_entry - 1, 2 do
    -- A template with a count is stored (zdelay_refs_apply writes and
    -- deletes the two together): for a template in use, the one read of its
    -- count answers both questions. Only without one is the record looked for.
    local tid = ARGV[i]
    local count = redis.call('HGET', templates, '#' .. tid) or false
    counts[tid] = count
    if not (count and string.match(count, '^%d+$'))
        and redis.call('HEXISTS', templates, tid) == 0 then
      created[tid] = true
    end
  end
  local any_leased = false
  for i = first_entry, #ARGV, 5 do
    local id, ms = ARGV[i], tonumber(ARGV[i + 2])
    -- Template reference counts: each entry adds one to its template and
    -- takes one from the payload it replaces (an id twice in one call: the
    -- first occurrence's, as it holds it by then).
    local old, stored = holds[id], false
    if old == nil then
      local payload = redis.call('HGET', msg, id)
      stored = payload ~= false
      old = zdelay_template_id(payload) or false
    end
    if old then zdelay_count(delta, old, -1) end
    local new = zdelay_template_id(ARGV[i + 3]) or false
    if new then
      zdelay_count(delta, new, 1)
      keep[new] = true
    end
    holds[id] = new
    local due_ms = ms
    if ARGV[i + 1] == 'r' then due_ms = now_ms + ms end
    local score = score_for(due_ms)
    if not lowest or score < lowest then
      lowest = score
      wake = not earlier[due_ms]
    end
    -- A new park of an id that is being released takes the id over: the
    -- release in flight can no longer acknowledge (and delete) the new payload.
    local leased_now = redis.call('ZSCORE', lease, id) ~= false
    any_leased = any_leased or leased_now
    if stored and not forgotten[id] and redis.call('HEXISTS', marks, 'i:' .. id) == 1 then
      -- Parked again under its id, with a key or tags: the new entry has
      -- none of its own (park_keyed.lua writes them after this script).
      forgotten[id] = true
      forget[#forget + 1] = id
    end
    if stored and not leased_now then
      -- Stored already and not being released: waiting in the due set, or
      -- held back by a pause or rate limit, which it leaves as a released
      -- one leaves the lease. (A payload no held set has, with every held
      -- set given, is a stray: nothing to leave.)
      local state, from = zdelay_where(place, id)
      if state == 'held' then
        if from then
          unheld[id] = from
        else
          if lanes_complete == nil then
            lanes_complete = zdelay_lanes_given(layout.lanes, layout.names)
          end
          lanes_stale = lanes_stale or not lanes_complete
        end
      end
    end
    entries[#entries + 1] = {id, due_ms, score, leased_now}
  end
  if any_leased then zdelay_expect(leased, 'hash') end
  refs = zdelay_refs_plan(templates, delta, created, counts)
  forget_plan = zdelay_marks_plan(marks, tagged, forget, 'cancel', now_ms)
end
local read_ok, read_error = pcall(read)
if not read_ok then
  zdelay_expect_park()  -- raises the error that says the fix, for a key of another type
  error(read_error, 0)
end
if lanes_stale then return {-2} end

-- The first write: a set of another type fails it before anything is written.
local named, names = {}, {}
for i = first_entry, #ARGV, 5 do
  local dest = ARGV[i + 4]
  if dest ~= '' and not named[dest] then
    named[dest] = true
    names[#names + 1] = dest
  end
end
if #names > 0 then
  local added, failure = pcall(function() return redis.call('SADD', dests, unpack(names)) end)
  if not added then
    zdelay_expect(dests, 'set')  -- raises the error that says the fix, for another type
    error(failure, 0)
  end
end

local result = {}
for e, entry in ipairs(entries) do result[e] = entry[2] end

-- A client whose reply was lost (Redis restarted) retries the call; if the
-- first attempt ran, its entries may already be released: parking them again
-- would release them twice. The marker remembers the first attempt. It is
-- set only where absent, so the common path pays one command for it (not a
-- read first): a retry finds it there and returns the first attempt's due
-- times, having written nothing but the destination set's members the first
-- attempt added already. (Not SET ... NX GET in one: Redis 6.2 refuses it.)
if not redis.call('SET', marker, table.concat(result, ','), 'NX', 'PX', ARGV[2]) then
  local previous = {}
  for ms in string.gmatch(redis.call('GET', marker), '[^,]+') do
    previous[#previous + 1] = tonumber(ms)
  end
  return previous
end

local stored = {}
for i = first_template, first_entry - 1, 2 do
  if created[ARGV[i]] then stored[#stored + 1] = {ARGV[i], ARGV[i + 1]} end
end
for _, entry in ipairs(entries) do entry[5] = unheld[entry[1]] end
-- Each payload stamped as it is written: one copy alive at a time.
local function payload(e) return stamped(ARGV[first_entry + 5 * (e - 1) + 3]) end
zdelay_t_park({due = due, msg = msg, lease = lease, leased = leased, templates = templates,
  marks = marks, tagged = tagged}, entries, payload, stored, forget_plan, refs, keep)

-- Only when the earliest due time moved earlier: nothing was due before
-- the earliest entry of this call.
if wake then
  zdelay_wake(ARGV[1], math.floor(lowest / 1024))
end
return result
