-- Put off a planner's next look at schedules whose next occurrence is far
-- ahead (PeriodicServer: more than PARK_LEAD_MS): it is parked within the
-- hour before it is due, not at once, so a first start over many schedules
-- (or many ticks at one instant) does not park them all in one pass.
--
-- KEYS[1] pointers hash    name -> pointer record (see define.lua)
-- KEYS[2] runs hash        name -> last occurrence released (see record_runs.lua)
-- KEYS[3] visits zset      name -> ms a planner pass looks at it from (see
--                          _pointer.lua): a schedule paused or removed is not in it
-- ARGV quintuples: name, version and pointer ms the plan was made from,
--   the ms to look at it again ("wake"), its next occurrence's ms ("next":
--   what "periodic list" shows until it is parked)
-- returns how many were put off: a schedule changed, moved, paused or
--   removed since it was read is left as it is (its record is another
--   plan's), and one with an occurrence parked that waits for its run is
--   still looked at for that run (periodic_next_visit ignores the wake)
local pointers, runs, visits = KEYS[1], KEYS[2], KEYS[3]
zdelay_expect(pointers, 'hash', runs, 'hash', visits, 'zset')
if #ARGV % 5 ~= 0 then error('defer takes name, version, ms, wake, next for each schedule') end
local done = 0
for i = 1, #ARGV, 5 do
  local name, wake, next_ms = ARGV[i], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  if not wake or not next_ms then error('defer: wake and next must be ms, not ' .. ARGV[i + 3]) end
  local r = periodic_pointer(pointers, name)
  if r and tostring(r.v) == ARGV[i + 1] and tonumber(r.ms) == tonumber(ARGV[i + 2])
      and redis.call('ZSCORE', visits, name) then
    r.wake, r.next = wake, next_ms
    redis.call('HSET', pointers, name, cjson.encode(r))
    redis.call('ZADD', visits, periodic_next_visit(r, runs, name), name)
    done = done + 1
  end
end
return done
