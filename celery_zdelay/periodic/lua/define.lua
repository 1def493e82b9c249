-- Store periodic task definitions: a companion's beat_schedule, or one entry.
--
-- KEYS[1] defs hash        name -> definition JSON
-- KEYS[2] versions hash    name -> version (only grows, also across removals)
-- KEYS[3] pointers hash    name -> {"v": version, "ms": newest occurrence parked
--                          (or the anchor), "ids": [[ms, id], ...] parked lately}
-- KEYS[4] paused set       names
-- KEYS[5] cancel set       occurrence ids every companion cancels (then forgets)
-- KEYS[6] meta hash        hash, written_by, written_ms of the stored configuration
-- KEYS[7] superseded set   configuration hashes replaced by a newer one
-- ARGV[1] mode             "config": replace the entries from configuration
--                          "put": add or replace ARGV[5..6]; "drop": remove ARGV[5..]
-- ARGV[2] configuration hash ("config" mode)
-- ARGV[3] "1": write even a superseded configuration (a deliberate rollback)
-- ARGV[4] writer (companion id)
-- ARGV[5..] "config"/"put": name, definition JSON pairs; "drop": names
--           ("config": an empty definition keeps what is stored under that
--           name: the entry is in the configuration but this companion
--           cannot serve it, e.g. its task module does not import here)
-- returns {status, names changed...}; status "same" (configuration already
--         stored), "older" (superseded: not written), "done"
--
-- Everything that can fail is checked before the first write (key types,
-- version counters): a failure leaves every schedule as it was.
if redis.replicate_commands then redis.replicate_commands() end

local defs, versions, pointers, paused, cancel, meta, superseded =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local mode = ARGV[1]
zdelay_expect(defs, 'hash', versions, 'hash', pointers, 'hash', paused, 'set', cancel, 'set',
  meta, 'hash', superseded, 'set')
local now_ms = zdelay_now_ms()

-- Occurrences parked ahead for a definition that changes or goes away are
-- cancelled by whichever companion passes next (the cancel set survives a
-- crash here). Those already due are kept: each is released once, as it
-- would have been without the change (it may be waiting for a broker).
-- Returns them.
local function cancel_ahead(name)
  local ahead, due = periodic_parked(periodic_pointer(pointers, name), now_ms)
  for _, pair in ipairs(ahead) do redis.call('SADD', cancel, pair[2]) end
  return due
end

local function drop(name)
  if redis.call('HEXISTS', defs, name) == 0 then return false end
  cancel_ahead(name)
  redis.call('HDEL', defs, name)
  redis.call('HDEL', pointers, name)
  redis.call('SREM', paused, name)
  return true
end

-- A new or changed definition gets a new version and starts from now; the
-- old version's occurrences already due stay listed (a pause still cancels them).
local function put(name, body)
  if redis.call('HGET', defs, name) == body then return false end
  local due = cancel_ahead(name)
  local version = redis.call('HINCRBY', versions, name, 1)
  redis.call('HSET', defs, name, body)
  redis.call('HSET', pointers, name, cjson.encode({v = version, ms = now_ms, ids = due}))
  return true
end

-- HINCRBY fails on a version that is not a count: check every one first.
if mode == 'put' then
  zdelay_expect_field_counter(versions, ARGV[5])
elseif mode == 'config' then
  for i = 5, #ARGV, 2 do zdelay_expect_field_counter(versions, ARGV[i]) end
end

local changed = {}
if mode == 'drop' then
  for i = 5, #ARGV do
    if drop(ARGV[i]) then changed[#changed + 1] = ARGV[i] end
  end
  return {'done', unpack(changed)}
end
if mode == 'put' then
  if put(ARGV[5], ARGV[6]) then changed[1] = ARGV[5] end
  return {'done', unpack(changed)}
end

-- "config": the newest configuration wins. One that was replaced before
-- (a companion of the previous deploy, restarted) is never written again.
local hash = ARGV[2]
local current = redis.call('HGET', meta, 'hash')
if current == hash then return {'same'} end
if ARGV[3] ~= '1' and redis.call('SISMEMBER', superseded, hash) == 1 then
  return {'older', current or ''}
end
local incoming = {}
for i = 5, #ARGV, 2 do incoming[ARGV[i]] = true end
local stored = redis.call('HGETALL', defs)
for i = 1, #stored, 2 do
  local name = stored[i]
  if not incoming[name] then
    local ok, d = pcall(cjson.decode, stored[i + 1])
    if ok and type(d) == 'table' and d.source == 'config' and drop(name) then
      changed[#changed + 1] = name
    end
  end
end
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] ~= '' and put(ARGV[i], ARGV[i + 1]) then changed[#changed + 1] = ARGV[i] end
end
if current then redis.call('SADD', superseded, current) end
redis.call('SREM', superseded, hash)
redis.call('HSET', meta, 'hash', hash, 'written_by', ARGV[4], 'written_ms', now_ms)
return {'done', unpack(changed)}
