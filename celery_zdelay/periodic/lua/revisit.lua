-- Put schedules back in the visits zset at the ms their stored state says
-- (see _pointer.lua), forgetting the ids their pointers list that are older
-- than advance.lua keeps. A planner pass calls it for a schedule it looked
-- at and left as it was, when its score is not what that state gives (an
-- occurrence parked and never run: withdrawn by the missed policy,
-- cancelled, dead-lettered), and a companion for every schedule when the
-- zset does not hold what it should (a store written before it existed).
--
-- KEYS[1] defs hash, KEYS[2] pointers hash, KEYS[3] paused set,
-- KEYS[4] runs hash, KEYS[5] visits zset (see define.lua, record_runs.lua)
-- ARGV[1] ids of occurrences before this ms are forgotten (as advance.lua's ARGV[4])
-- ARGV[2..] names
-- returns how many names are in the visits zset now (those stored and not paused)
if redis.replicate_commands then redis.replicate_commands() end

local defs, pointers, paused, runs, visits = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
zdelay_expect(defs, 'hash', pointers, 'hash', paused, 'set', runs, 'hash', visits, 'zset')
local keep_after = tonumber(ARGV[1])
if not keep_after then error('revisit needs the ms before which ids are forgotten') end
local listed = 0
for i = 2, #ARGV do
  local name = ARGV[i]
  if redis.call('HEXISTS', defs, name) == 0 or redis.call('SISMEMBER', paused, name) == 1 then
    redis.call('ZREM', visits, name)
  else
    local r = periodic_pointer(pointers, name)
    if r and type(r.ids) == 'table' then
      local ids = {}
      for _, pair in ipairs(r.ids) do
        if type(pair) ~= 'table' or type(pair[1]) ~= 'number' or pair[1] >= keep_after then
          ids[#ids + 1] = pair
        end
      end
      if #ids < #r.ids then
        r.ids = ids
        redis.call('HSET', pointers, name, cjson.encode(r))
      end
    end
    redis.call('ZADD', visits, periodic_next_visit(r, runs, name), name)
    listed = listed + 1
  end
end
return listed
