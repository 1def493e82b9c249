-- Loaded in front of define.lua and pause.lua (after _pointer.lua and
-- _transitions.lua): take a
-- schedule's occurrences back from the shards, in the same script as the
-- change that makes them obsolete, so that once the change is written no
-- companion can release one of them any more.
--
-- The shard keys come last in KEYS, five per shard, from index *first*:
-- due zset, msg hash, lease zset, leased hash, templates hash (see
-- store/redis_keys.py). A store on a Redis Cluster passes none (its shards are
-- other slots): the caller then lists the ids in the cancel set instead.

-- The shards named in KEYS from index *first*, their key types checked
-- (call it before the first write).
local function periodic_shards(first)
  local shards = {}
  for i = first, #KEYS, 5 do
    local s = {due = KEYS[i], msg = KEYS[i + 1], lease = KEYS[i + 2], leased = KEYS[i + 3],
               templates = KEYS[i + 4]}
    zdelay_expect(s.due, 'zset', s.msg, 'hash', s.lease, 'zset', s.leased, 'hash',
      s.templates, 'hash')
    shards[#shards + 1] = s
  end
  return shards
end

-- Reads only: where each of *ids* still waits (parked, or leased: claimed
-- by a companion for the generic path, back in the due set if that
-- companion dies), and the template counts to write. Returns a plan for
-- periodic_withdraw_apply.
local function periodic_withdraw_plan(shards, ids)
  local plan = {}
  for _, s in ipairs(shards) do
    local found, delta = {}, {}
    for _, id in ipairs(ids) do
      local where = nil
      if redis.call('ZSCORE', s.due, id) then
        where = 'due'
      elseif redis.call('ZSCORE', s.lease, id) then
        where = 'lease'
      end
      if where then
        found[#found + 1] = {id, where}
        zdelay_count(delta, zdelay_template_id(redis.call('HGET', s.msg, id)), -1)
      end
    end
    plan[#plan + 1] = {s, found, zdelay_refs_plan(s.templates, delta)}
  end
  return plan
end

-- The ids of *ids* that *plan* does not take back: released already, or
-- held back by a pause or a rate limit, in a held set this script is not
-- given (their names change at run time). The caller lists them in the
-- cancel set, and every companion (and the caller, before it returns)
-- cancels them where they are held (Store.cancel looks in the held sets).
local function periodic_withdraw_rest(plan, ids)
  local found = {}
  for _, item in ipairs(plan) do
    for _, pair in ipairs(item[2]) do found[pair[1]] = true end
  end
  local rest = {}
  for _, id in ipairs(ids) do
    if not found[id] then rest[#rest + 1] = id end
  end
  return rest
end

-- Writes *plan*; returns id -> 'due' or 'lease' for the ids taken back. An
-- id leased to a companion may be on its way to the broker already (the
-- tick in flight): its ack then finds nothing to acknowledge, and it is
-- never released again.
local function periodic_withdraw_apply(plan)
  local taken = {}
  for _, item in ipairs(plan) do
    local s, found, refs = item[1], item[2], item[3]
    local entries = {}
    for j, pair in ipairs(found) do
      entries[j] = {pair[1], pair[2] == 'due' and s.due or s.lease}
      taken[pair[1]] = pair[2]
    end
    -- Occurrences carry no key or tags (no marks to leave with them).
    zdelay_t_cancel(s, entries, refs, nil)
  end
  return taken
end
