-- Run in front of park.lua (both after _guard.lua): park a task message that
-- ``zdelay adopt`` took from a broker queue, only the first time it is adopted.
--
-- KEYS[1..10] as park.lua, with no held set given and no other shard
-- KEYS[11] adopted zset  "<id>\n<fingerprint>" -> ms until which it is remembered
-- ARGV as park.lua, with exactly one entry, then
-- ARGV[#ARGV - 1] the message's fingerprint (celery_zdelay/adoption.py: what a
--         redelivery of the message cannot change)
-- ARGV[#ARGV] ms to remember it after its due time
-- returns {0} when this message was adopted before (its copy is parked, or was
--         released already: parking it again would run it twice), {-1} when an
--         entry is stored under its id already (parked, held or in flight: not
--         replaced), else what park.lua returns (the entry's due ms)
--
-- adopt parks a message, then acknowledges it to the broker. Killed between
-- the two, it leaves the message parked and still in the queue, and the
-- broker gives it back; the record written here, in the step that parks,
-- tells the next run that it is a copy of one parked already.
if redis.replicate_commands then redis.replicate_commands() end

local adopt_layout = zdelay_park_layout()
local adopt_set = KEYS[adopt_layout.first_other]
-- park.lua would take it for another shard's keys to check
KEYS[adopt_layout.first_other] = nil
-- Taken off ARGV: park.lua reads entries to its end.
local adopt_keep_ms = tonumber(ARGV[#ARGV])
ARGV[#ARGV] = nil
local adopt_print = ARGV[#ARGV]
ARGV[#ARGV] = nil
-- adopt parks a message at its own eta: an absolute due time ('a')
if not adopt_keep_ms or not adopt_print or #ARGV ~= adopt_layout.first_entry + 4
    or ARGV[adopt_layout.first_entry + 1] ~= 'a' then
  error({err = 'ERR celery-zdelay adopt_once: one entry at an absolute due time, its ' ..
    'fingerprint and the ms to keep it'})
end
-- Everything park.lua checks is checked before the record is written: a
-- message recorded as adopted but not parked would be taken for a copy and
-- dropped by the next run.
zdelay_expect_park()
zdelay_expect(adopt_set, 'zset')
local adopt_id = ARGV[adopt_layout.first_entry]
local adopt_member = adopt_id .. '\n' .. adopt_print
local adopt_now = zdelay_now_ms()
redis.call('ZREMRANGEBYSCORE', adopt_set, '-inf', adopt_now)
if redis.call('ZSCORE', adopt_set, adopt_member) then return {0} end
-- Another entry under its id (the same task parked by other means) is not
-- replaced: the message goes back to its queue as it was.
if redis.call('HEXISTS', KEYS[2], adopt_id) == 1 then return {-1} end
local adopt_due = tonumber(ARGV[adopt_layout.first_entry + 2])
redis.call('ZADD', adopt_set, string.format('%.0f', adopt_due + adopt_keep_ms), adopt_member)
