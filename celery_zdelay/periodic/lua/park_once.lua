-- Run in front of park.lua (both after _guard.lua): park a periodic
-- occurrence only the first time anyone parks it.
--
-- KEYS[1..10] as park.lua, with no held set given and no other shard
-- KEYS[11] ticks zset   occurrence id -> ms it was first parked
-- KEYS[12] periodic pointers hash, KEYS[13] periodic paused set (optional:
--         not on a Redis Cluster, where they are another slot): an
--         occurrence of a version that is no longer current, or of a
--         paused schedule, is refused, so a companion that read the
--         schedule before a change or pause cannot park it afterwards
-- ARGV as park.lua, with exactly one entry
-- ARGV[#ARGV - 1] (after park.lua's) the occurrence's ms: listed with the id
--         in its schedule's pointer (see define.lua)
-- ARGV[#ARGV] ms to remember the id for (see PeriodicStore.park_once)
-- returns {} when the id was parked before (it may be released already:
--         parking it again would run it twice; or it waits held back by a
--         pause or rate limit, which the tick memory may have forgotten)
--         or is refused, else what park.lua returns
if redis.replicate_commands then redis.replicate_commands() end

local once_layout = zdelay_park_layout()
local once_at = once_layout.first_other
local once_ticks, once_pointers, once_paused = KEYS[once_at], KEYS[once_at + 1], KEYS[once_at + 2]
-- park.lua would take them for another shard's keys to check
KEYS[once_at], KEYS[once_at + 1], KEYS[once_at + 2] = nil, nil, nil
-- Remembered for an hour after parking (by default): longer than any
-- companion takes between reading a schedule's pointer and parking what
-- follows it. (Removed from ARGV: park.lua reads entries to its end.)
local ONCE_KEEP_MS = tonumber(ARGV[#ARGV])
ARGV[#ARGV] = nil
local ONCE_MS = tonumber(ARGV[#ARGV])
ARGV[#ARGV] = nil
-- The tick below is written before park.lua runs: everything park.lua
-- checks is checked first (an occurrence ticked but not parked would never
-- be parked again).
zdelay_expect_park()
zdelay_expect(once_ticks, 'zset')
local once_id = ARGV[once_layout.first_entry]
if not ONCE_KEEP_MS then error('park_once needs the ms to remember an occurrence') end
if not ONCE_MS then error("park_once needs the occurrence's ms") end
local once_now = zdelay_now_ms()
-- The schedule's name and pointer record, when the id is an occurrence's
-- and its pointer is given.
local once_name, once_pointer = nil, nil
if once_pointers then
  zdelay_expect(once_pointers, 'hash', once_paused, 'set')
  local name, version = string.match(once_id, '^periodic:(.+):v(%d+):%d+%-%d+%-%d+T[%d:%.]+Z$')
  if name then
    if redis.call('SISMEMBER', once_paused, name) == 1 then return {} end
    local ok, r = pcall(cjson.decode, redis.call('HGET', once_pointers, name) or '')
    if not ok or type(r) ~= 'table' or tostring(r.v) ~= version then return {} end
    once_name, once_pointer = name, r
  end
end
if redis.call('ZSCORE', once_ticks, once_id) then return {} end
-- Held back by a pause or rate limit, it was parked before, however long
-- ago (the tick memory forgets after an hour): it runs when let go.
-- (Given no held set, park.lua could not take it out of one.)
if redis.call('HEXISTS', KEYS[2], once_id) == 1
    and zdelay_where({due = KEYS[1], lease = KEYS[3], msg = KEYS[2]}, once_id) == 'held' then
  return {}
end
redis.call('ZREMRANGEBYSCORE', once_ticks, '-inf', once_now - ONCE_KEEP_MS)
redis.call('ZADD', once_ticks, once_now, once_id)
-- Listed in its pointer, and counted (its "n", see advance.lua), in this
-- same script: a change of the schedule (define.lua) or a pause
-- (pause.lua) takes back what the pointer lists, so from now on it takes
-- this occurrence back too. Listed only by the planner's next call
-- (advance.lua), a change landing between the two calls left it parked
-- under the old version until the planner cancelled it, a call later: a
-- tick due meanwhile ran under a version already replaced.
if once_pointer then
  if type(once_pointer.ids) ~= 'table' then once_pointer.ids = {} end
  table.insert(once_pointer.ids, {ONCE_MS, once_id})
  once_pointer.n = (tonumber(once_pointer.n) or 0) + 1
  redis.call('HSET', once_pointers, once_name, cjson.encode(once_pointer))
end

