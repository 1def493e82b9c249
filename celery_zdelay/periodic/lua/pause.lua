-- Pause or resume one schedule.
--
-- KEYS[1] defs hash
-- KEYS[2] pointers hash    (see define.lua)
-- KEYS[3] paused set
-- KEYS[4] cancel set
-- KEYS[5] versions hash    (see define.lua)
-- KEYS[6] visits zset      (see _pointer.lua): a paused schedule is not in it
-- KEYS[7..] the shards' keys, five per shard (see _withdraw.lua); none on a
--           Redis Cluster
-- ARGV[1] "pause" or "resume"
-- ARGV[2] name
-- returns {1} done, {0} no such schedule, {2} already so; a pause that took
--         occurrences back from a due set (they never run) names them after
--         its 1, for the caller to record as cancelled
if redis.replicate_commands then redis.replicate_commands() end

local defs, pointers, paused, cancel, versions, visits =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local name = ARGV[2]
-- Everything that can fail is checked before the first write.
zdelay_expect(defs, 'hash', pointers, 'hash', paused, 'set', cancel, 'set', versions, 'hash',
  visits, 'zset')
local shards = periodic_shards(7)
if redis.call('HEXISTS', defs, name) == 0 then return {0} end
local r = periodic_pointer(pointers, name)
if ARGV[1] == 'pause' then
  if redis.call('SISMEMBER', paused, name) == 1 then return {2} end
  -- What was parked would still run, even what is due already: take it
  -- back in this script, so that none runs once the pause is written
  -- (only one a companion is publishing at this instant is in flight).
  local ahead, due = periodic_parked(r, 0)
  local ids = {}
  for _, list in ipairs({ahead, due}) do
    for _, pair in ipairs(list) do ids[#ids + 1] = pair[2] end
  end
  local plan = periodic_withdraw_plan(shards, ids)
  redis.call('SADD', paused, name)
  redis.call('ZREM', visits, name)
  local done = {1}
  if #shards > 0 then
    -- Those taken back from the due set never ran: they no longer count
    -- against zdelay_max_runs (those leased are in flight and run).
    local unrun = 0
    for id, where in pairs(periodic_withdraw_apply(plan)) do
      if where == 'due' then
        unrun = unrun + 1
        done[#done + 1] = id
      end
    end
    if r and unrun > 0 and tonumber(r.n) then
      r.n = math.max(0, tonumber(r.n) - unrun)
      redis.call('HSET', pointers, name, cjson.encode(r))
    end
    -- Held back by a pause or a rate limit, they would run at the resume.
    for _, id in ipairs(periodic_withdraw_rest(plan, ids)) do redis.call('SADD', cancel, id) end
  else
    for _, id in ipairs(ids) do redis.call('SADD', cancel, id) end
  end
  return done
end
if redis.call('SISMEMBER', paused, name) == 0 then return {2} end
zdelay_expect_field_counter(versions, name)
redis.call('SREM', paused, name)
-- Resumed from now: occurrences while paused do not count as missed.
-- A new version gives the occurrences new ids: those cancelled by the pause
-- are remembered as parked (park_once), so under the old ids a calendar
-- schedule's next tick would never be parked again.
-- (A pointer that could not be read is written afresh.)
r = r or {}
r.v = redis.call('HINCRBY', versions, name, 1)
r.ms = zdelay_now_ms()
r.ids = {}
redis.call('HSET', pointers, name, cjson.encode(r))
redis.call('ZADD', visits, periodic_next_visit(r, nil, name), name)
return {1}
