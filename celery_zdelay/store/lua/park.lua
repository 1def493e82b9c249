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
-- KEYS[8..] six per other shard of the same batch on this Redis server (its
--           keys 1-5 and 7): checked too, so that a batch one shard cannot
--           take fails in every shard's call before any of them writes (a
--           MULTI/EXEC does not undo the calls that ran before a failing one)
-- ARGV[1] wake channel, published to when the earliest due time moves earlier
--         (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2] ms the call marker lives (longer than the caller's retries take)
-- ARGV[3] number of templates that follow
-- ARGV[4..] two per template: id, record (stored once; ids are content hashes)
-- then five per entry: id, mode, ms, payload, dest
--           mode "r": due ms after the Redis clock; "a": absolute epoch ms
--           dest "": no handoff destination
-- returns the due ms of each entry, in argument order
--
-- Each payload is stored with when it was parked on the Redis clock: "p":<ms>
-- spliced first into its metadata line ({"p":<ms>,"v":1,...}), replacing
-- one a re-parked payload carries. It is outside what a signature covers
-- (entry.py signs the envelope and its routing, never the metadata line). A
-- message stored whole (zdelay_whole_messages) has no such line.
if redis.replicate_commands then redis.replicate_commands() end

local due, msg, lease, leased, dests, marker, templates =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

-- A client whose reply was lost (Redis restarted) retries the call; if the
-- first attempt ran, its entries may already be released: parking them again
-- would release them twice. The marker remembers the first attempt.
local done = redis.call('GET', marker)
if done then
  local previous = {}
  for ms in string.gmatch(done, '[^,]+') do previous[#previous + 1] = tonumber(ms) end
  return previous
end

zdelay_expect_park()
local n_templates = tonumber(ARGV[3])
local first_entry = 4 + 2 * n_templates
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
    local restamped, found = gsub(payload, '^{"p":%d+,', stamp, 1)
    if found == 1 then return restamped end
  end
  return (gsub(payload, '^{', stamp, 1))
end

-- Same-millisecond entries keep parking order: each takes the next of the
-- 1024 sequence slots of its millisecond (the last slot is shared once full).
local last_seq = {}
local function score_for(due_ms)
  local lo = due_ms * 1024
  local score = last_seq[due_ms]
  if score then
    score = score + 1
  else
    local top = redis.call('ZREVRANGEBYSCORE', due, lo + 1023, lo, 'WITHSCORES', 'LIMIT', 0, 1)
    if top[2] then score = tonumber(top[2]) + 1 else score = lo end
  end
  if score > lo + 1023 then score = lo + 1023 end
  last_seq[due_ms] = score
  return score
end

-- Template reference counts, read before the first write: each entry adds
-- one to its template and takes one from the payload it replaces.
local created, delta, keep, holds = {}, {}, {}, {}
for i = 4, 3 + 2 * n_templates, 2 do
  if redis.call('HEXISTS', templates, ARGV[i]) == 0 then created[ARGV[i]] = true end
end
for i = first_entry, #ARGV, 5 do
  local id = ARGV[i]
  local old = holds[id]
  if old == nil then old = zdelay_template_id(redis.call('HGET', msg, id)) or false end
  if old then zdelay_count(delta, old, -1) end
  local new = zdelay_template_id(ARGV[i + 3]) or false
  if new then
    zdelay_count(delta, new, 1)
    keep[new] = true
  end
  holds[id] = new
end
local refs = zdelay_refs_plan(templates, delta, created)

for i = 4, 3 + 2 * n_templates, 2 do
  redis.call('HSETNX', templates, ARGV[i], ARGV[i + 1])
end

local head = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
local before = tonumber(head[2])
local lowest = nil
local result = {}
local named = {}
for i = first_entry, #ARGV, 5 do
  local id, mode, ms, payload, dest = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3], ARGV[i + 4]
  local due_ms = ms
  if mode == 'r' then due_ms = now_ms + ms end
  -- A new park of an id that is being released takes the id over: the
  -- release in flight can no longer acknowledge (and delete) the new payload.
  if redis.call('ZSCORE', lease, id) then
    redis.call('ZREM', lease, id)
    redis.call('HDEL', leased, id)
  end
  local score = score_for(due_ms)
  redis.call('ZADD', due, score, id)  -- replaces the score of an id parked before
  redis.call('HSET', msg, id, stamped(payload))
  if dest ~= '' and not named[dest] then
    named[dest] = true
    redis.call('SADD', dests, dest)
  end
  if not lowest or score < lowest then lowest = score end
  result[#result + 1] = due_ms
end

zdelay_refs_apply(templates, refs, keep)

if lowest and (not before or lowest < before) then
  zdelay_wake(ARGV[1], math.floor(lowest / 1024))
end
redis.call('SET', marker, table.concat(result, ','), 'PX', ARGV[2])
return result
