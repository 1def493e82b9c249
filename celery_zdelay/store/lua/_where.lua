-- Loaded in front of the scripts that ask where an id is now (see
-- scripts.py and marks.py): one answer, read one way by every script, so a
-- state added later is added here once and no script misses it.
--
-- A parked id is in one place on its shard:
--   "due"        the due set: waiting for its time
--   "held"       the held set of a pause or rate limit (hold.lua): due,
--                and held back until its control lets it go
--   "in_flight"  the lease: claimed by a companion, being released
-- Its payload is in the msg hash in all three. A held entry is the one whose
-- payload is there while neither the due set nor the lease has it, so a
-- script learns that an id is held without knowing the held sets' names;
-- only a script that moves a held entry needs the name of its set, which
-- it is given with the others of the shard (the lanes set names them).

-- Where *id* is: "due", "held", "in_flight", or nil when it is not parked
-- (unknown, released, dead-lettered only). *place* names the shard's keys:
-- {due =, lease =, msg =, held = {held zsets given} (optional)}. For "due"
-- and "held" also returns the set that has it and its due score; for "held"
-- in a set not given, neither (see zdelay_lanes_given).
local function zdelay_where(place, id)
  local score = redis.call('ZSCORE', place.due, id)
  if score then return 'due', place.due, score end
  if redis.call('ZSCORE', place.lease, id) then return 'in_flight' end
  if redis.call('HEXISTS', place.msg, id) == 0 then return nil end
  for _, key in ipairs(place.held or {}) do
    score = redis.call('ZSCORE', key, id)
    if score then return 'held', key, score end
  end
  return 'held'
end

-- Whether the control names *given* cover every held set of the shard (its
-- lanes set). When they do, a payload that none of the sets has is a stray
-- (written by something else): nothing releases it, so it is not parked.
local function zdelay_lanes_given(lanes, given)
  local named = {}
  for _, name in ipairs(given) do named[name] = true end
  for _, name in ipairs(redis.call('SMEMBERS', lanes)) do
    if not named[name] then return false end
  end
  return true
end
