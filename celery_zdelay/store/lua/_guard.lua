-- Loaded in front of every script (see scripts.py). Redis does not roll a
-- script back when a command fails halfway, so every script calls these
-- checks before its first write: after that write, no command it makes can
-- fail. (Out of memory and read-only replicas refuse the first write only:
-- once a script has written, Redis lets it finish.)

-- Raise, before any write, when a key holds another type than the script
-- uses it as; "none" (absent) is always fine. Arguments: key, type, ...
local function zdelay_expect(...)
  local spec = {...}
  for i = 1, #spec, 2 do
    local actual = redis.call('TYPE', spec[i])['ok']
    if actual ~= 'none' and actual ~= spec[i + 1] then
      error({err = 'WRONGTYPE celery-zdelay key ' .. spec[i] .. ' holds a ' .. actual ..
        ', not a ' .. spec[i + 1] .. ': something else wrote it; give celery-zdelay its own ' ..
        'zdelay_key_prefix or database, or delete that key'})
    end
  end
end

-- Raise, before any write, when the counter key holds something INCRBY
-- cannot count on; return its value.
local function zdelay_expect_counter(key)
  zdelay_expect(key, 'string')
  local value = redis.call('GET', key)
  if value and not string.match(value, '^%d+$') then
    error({err = 'WRONGTYPE celery-zdelay counter ' .. key .. ' holds ' .. string.sub(value, 1, 40) ..
      ', not a count: delete that key'})
  end
  return tonumber(value or 0)
end

-- Raise, before any write, when field *field* of hash *key* (checked to be
-- a hash) holds something HINCRBY cannot count on: up to 18 digits, it can
-- always add one.
local function zdelay_expect_field_counter(key, field)
  local value = redis.call('HGET', key, field)
  if value and not (string.match(value, '^%d+$') and #value <= 18) then
    error({err = 'WRONGTYPE celery-zdelay counter ' .. field .. ' of ' .. key .. ' holds ' ..
      string.sub(value, 1, 40) .. ', not a count: delete that field (HDEL)'})
  end
end

-- *value* as a number ZADD takes, or nil: tonumber() also reads "nan",
-- which ZADD refuses (after the script may have written).
local function zdelay_number(value)
  local number = tonumber(value)
  if number == nil or number ~= number then return nil end
  return number
end

-- Where park.lua's arguments (see there) are, past its fixed ones: the
-- held sets given (KEYS[11..], their control names ARGV[5..]), then the
-- templates and the entries (ARGV), and the other shards' keys (KEYS).
-- One reading for every script that runs park.lua or reads its arguments
-- (park_keyed.lua, park_once.lua).
local function zdelay_park_layout()
  local n_templates = tonumber(ARGV[3])
  if not n_templates then
    error({err = 'ERR celery-zdelay park: no template count'})
  end
  local n_held = tonumber(ARGV[4])
  if not n_held then
    error({err = 'ERR celery-zdelay park: no held set count'})
  end
  local held, names = {}, {}
  for i = 1, n_held do
    held[i], names[i] = KEYS[10 + i], ARGV[4 + i]
  end
  return {
    lanes = KEYS[8], marks = KEYS[9], tagged = KEYS[10], held = held, names = names,
    first_template = 5 + n_held,
    first_entry = 5 + n_held + 2 * n_templates,
    first_other = 11 + n_held,
  }
end

-- The checks of zdelay_expect_park but for the keys of park.lua's own
-- shard: the keys of the other shards of a batch, and every entry's due time.
-- park.lua calls this alone: its reads before its first write check the
-- types of its own keys (see there).
local function zdelay_expect_park_args()
  local layout = zdelay_park_layout()
  for i = layout.first_other, #KEYS, 8 do
    zdelay_expect(KEYS[i], 'zset', KEYS[i + 1], 'hash', KEYS[i + 2], 'zset', KEYS[i + 3], 'hash',
      KEYS[i + 4], 'set', KEYS[i + 5], 'hash', KEYS[i + 6], 'hash', KEYS[i + 7], 'zset')
  end
  for i = layout.first_entry, #ARGV, 5 do
    local mode = ARGV[i + 1]
    if not zdelay_number(ARGV[i + 2]) or (mode ~= 'r' and mode ~= 'a') then
      error({err = 'ERR celery-zdelay park: entry ' .. ARGV[i] .. ' has no valid due time'})
    end
  end
  return layout
end

-- Raise, before any write, when park.lua's KEYS and ARGV (see there) hold
-- something it would fail on: a key of another type, an entry without a
-- valid due time. park_once.lua (periodic) calls it before writing its tick.
local function zdelay_expect_park()
  zdelay_expect(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'zset', KEYS[4], 'hash',
    KEYS[5], 'set', KEYS[7], 'hash', KEYS[8], 'set', KEYS[9], 'hash', KEYS[10], 'zset')
  local layout = zdelay_expect_park_args()
  for _, key in ipairs(layout.held) do zdelay_expect(key, 'zset') end
  return layout
end

-- The lease of an in-flight entry is two records: the lease zset scores it
-- by expiry (for recover.lua), the leased hash holds "<due score> <claim
-- token>". The token is unique per claim (a counter), so only the claim that
-- leased an entry can acknowledge, unclaim or dead-letter it.
local function zdelay_leased_value(score, token)
  return string.format('%.0f %d', tonumber(score), token)
end

-- Returns the due score of *id* when claim *token* owns its lease, else nil.
-- *seen* is the calling script's table of the ids it owns so far: an id
-- given twice is owned once (every script reads all its ids before its
-- first write, so a second one would be counted, and its template
-- released, twice).
local function zdelay_owned(lease, leased, id, token, seen)
  if seen[id] then return nil end
  local value = redis.call('HGET', leased, id)
  if not value then return nil end
  local score, owner = string.match(value, '^(%S+) (%d+)$')
  if not owner or tonumber(owner) ~= token then return nil end
  if not redis.call('ZSCORE', lease, id) then return nil end
  seen[id] = true
  return score
end


-- The due score a leased-hash value holds (also the older "<due score>" form).
local function zdelay_due_score(value)
  if not value then return nil end
  return zdelay_number(string.match(value, '^(%S+)'))
end

-- A dead-letter reason, as the companion writes them (see loop.py).
local function zdelay_reason(reason, due_ms, companion)
  return '{"reason":' .. cjson.encode(reason) .. ',"due_ms":' .. string.format('%.0f', due_ms) ..
    ',"companion":' .. cjson.encode(companion or '') .. '}'
end

local function zdelay_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Template reference counts. A template is kept while entries refer to it,
-- so the templates hash follows what is parked, not the history of calls.
-- The count of template <id> is the field "#<id>" of the templates hash
-- itself (ids are hex, so the names never meet). A template without a count
-- (parked by an earlier release, or whose count is unreadable) is kept for
-- good: a count that might be wrong never deletes a template in use.

-- The template id an entry's metadata line names (for an entry stored
-- whole, the route record its delivery tag names), or nil.
local function zdelay_template_id(payload)
  if not payload then return nil end
  if string.byte(payload, 3) == 98 then  -- {"b
    -- Stored whole (entry.py): no metadata line, and the message may hold
    -- '"t":"' anywhere. Its delivery tag ends it, at a fixed length:
    -- "delivery_tag":"zdelay.<16 hex: the route record's id>.<32 hex>"}}
    -- (checked by place rather than by pattern: the handoff reads every
    -- entry's, and a pattern costs it twice as much).
    local n = #payload
    if string.find(payload, '"delivery_tag":"zdelay.', n - 74, true) ~= n - 74
        or string.byte(payload, n - 35) ~= 46 or string.sub(payload, -3) ~= '"}}' then
      return nil
    end
    return string.sub(payload, n - 51, n - 36)
  end
  return string.match(payload, '^{[^\n]-"t":"(%x+)"')
end

-- Reads only (call it before the first write): the counts to write for
-- *delta* (template id -> change), as a list of {id, new count}. *created*
-- names the templates this call stores (they start counting from 0);
-- *counts* (optional) the count fields the caller read already (false:
-- none), which are not read again.
local function zdelay_refs_plan(templates, delta, created, counts)
  local plan = {}
  for tid, change in pairs(delta) do
    if change ~= 0 then
      local stored = counts and counts[tid]
      if stored == nil then stored = redis.call('HGET', templates, '#' .. tid) end
      local current = stored and string.match(stored, '^%d+$') and tonumber(stored)
      if current or (created and created[tid]) then
        plan[#plan + 1] = {tid, (current or 0) + change}
      end
    end
  end
  return plan
end

-- Adds *by* to delta[tid], ignoring entries without a template.
local function zdelay_count(delta, tid, by)
  if tid then delta[tid] = (delta[tid] or 0) + by end
end

-- Fills result[3] and result[4] of a claim or handoff reply: the due ms of
-- the earliest entry still parked and the earliest lease expiry (left as
-- they are when the set is empty), so the companion knows when to wake.
local function zdelay_next_events(result, due, lease)
  local head = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
  if head[2] then result[3] = math.floor(tonumber(head[2]) / 1024) end
  local first_lease = redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')
  if first_lease[2] then result[4] = tonumber(first_lease[2]) end
end

-- Wake sleeping companions: a message on the shard's wake channel. The one
-- step a script may take after its writes, so it must not fail: an ACL
-- user without the channel (Redis 7's default is resetchannels) gets an
-- error reply from redis.pcall instead of a failed script, and the entries
-- written stay written. Without it a companion still wakes on its own
-- timer (at most a second late); status and the companion's log name the
-- missing permission (health.py, wakeup.py).
local function zdelay_wake(channel, due_ms)
  redis.pcall('PUBLISH', channel, string.format('%.0f', due_ms))
end
