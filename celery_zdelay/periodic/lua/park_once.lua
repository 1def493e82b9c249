-- Run in front of park.lua (both after _guard.lua): park a periodic
-- occurrence only the first time anyone parks it.
--
-- KEYS[1..7] as park.lua
-- KEYS[8] ticks zset    occurrence id -> ms it was first parked
-- ARGV as park.lua, with exactly one entry
-- returns {} when the id was parked before (it may be released already:
--         parking it again would run it twice), else what park.lua returns
if redis.replicate_commands then redis.replicate_commands() end

local once_ticks = KEYS[8]
KEYS[8] = nil  -- park.lua would take it for another shard's key to check
-- The tick below is written before park.lua runs: everything park.lua
-- checks is checked first (an occurrence ticked but not parked would never
-- be parked again).
zdelay_expect_park()
zdelay_expect(once_ticks, 'zset')
local once_id = ARGV[4 + 2 * tonumber(ARGV[3])]
-- Remembered for an hour after parking: longer than any companion takes
-- between reading a schedule's pointer and parking what follows it.
local ONCE_KEEP_MS = 3600000
local once_now = zdelay_now_ms()
if redis.call('ZSCORE', once_ticks, once_id) then return {} end
redis.call('ZREMRANGEBYSCORE', once_ticks, '-inf', once_now - ONCE_KEEP_MS)
redis.call('ZADD', once_ticks, once_now, once_id)

