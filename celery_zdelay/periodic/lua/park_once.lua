-- Prefix of park.lua (loaded in front of it): park a periodic occurrence
-- only the first time anyone parks it.
--
-- KEYS[1..7] as park.lua
-- KEYS[8] ticks zset    occurrence id -> ms it was first parked
-- ARGV as park.lua, with exactly one entry
-- returns {} when the id was parked before (it may be released already:
--         parking it again would run it twice), else what park.lua returns
if redis.replicate_commands then redis.replicate_commands() end

local once_ticks = KEYS[8]
KEYS[8] = nil
local once_id = ARGV[4 + 2 * tonumber(ARGV[3])]
-- Remembered for an hour after parking: longer than any companion takes
-- between reading a schedule's pointer and parking what follows it.
local ONCE_KEEP_MS = 3600000
local once_time = redis.call('TIME')
local once_now = tonumber(once_time[1]) * 1000 + math.floor(tonumber(once_time[2]) / 1000)
-- park.lua checks its keys before writing; the tick below is written before
-- park.lua runs, so check them here first (an occurrence ticked but not
-- parked would never be parked again).
local once_types = {KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'zset', KEYS[4], 'hash',
  KEYS[5], 'set', KEYS[7], 'hash', once_ticks, 'zset'}
for i = 1, #once_types, 2 do
  local actual = redis.call('TYPE', once_types[i])['ok']
  if actual ~= 'none' and actual ~= once_types[i + 1] then
    return redis.error_reply('WRONGTYPE celery-zdelay key ' .. once_types[i] .. ' holds a ' ..
      actual .. ', not a ' .. once_types[i + 1] .. ': delete that key')
  end
end
if redis.call('ZSCORE', once_ticks, once_id) then return {} end
redis.call('ZREMRANGEBYSCORE', once_ticks, '-inf', once_now - ONCE_KEEP_MS)
redis.call('ZADD', once_ticks, once_now, once_id)

