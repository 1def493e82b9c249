-- Move a parked entry to a new due time, from the due set or from the held
-- set of a pause or rate limit (see hold.lua). Entries already claimed for
-- release are not moved.
--
-- A held entry goes back into the due set, in the same step that takes it
-- out of its held set (never in two places): when it falls due it passes the
-- gate again, and is held again if its control still holds it.
--
-- KEYS[1] due zset      id -> due_ms * 1024 + seq
-- KEYS[2] lanes set     names of the controls with a held set on this shard
-- KEYS[3..] held zsets  of the controls named in ARGV[5..], in that order
-- ARGV[1] wake channel, published to when the earliest due time moves earlier
--         (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2] id
-- ARGV[3] mode: "r" due ms after the Redis clock, "a" absolute epoch ms
-- ARGV[4] ms
-- ARGV[5..] control names of KEYS[3..]
-- returns the new due ms; -1 when the id is not parked; -2 when the lanes
-- set names a control not given (held sets were added: read it and call again)
if redis.replicate_commands then redis.replicate_commands() end
local due, lanes = KEYS[1], KEYS[2]
local id, mode, ms = ARGV[2], ARGV[3], zdelay_number(ARGV[4])
zdelay_expect(due, 'zset', lanes, 'set')
for i = 3, #KEYS do zdelay_expect(KEYS[i], 'zset') end
if not ms then error({err = 'ERR celery-zdelay reschedule: the due time is not a number'}) end
local from = nil
if redis.call('ZSCORE', due, id) then
  from = due
else
  for i = 3, #KEYS do
    if redis.call('ZSCORE', KEYS[i], id) then
      from = KEYS[i]
      break
    end
  end
end
if not from then
  -- "Not parked" is only true when every held set of the shard was looked in.
  local given = {}
  for i = 5, #ARGV do given[ARGV[i]] = true end
  for _, name in ipairs(redis.call('SMEMBERS', lanes)) do
    if not given[name] then return -2 end
  end
  return -1
end
local now_ms = zdelay_now_ms()
local due_ms = ms
if mode == 'r' then due_ms = now_ms + ms end

local head = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
local before = tonumber(head[2])
-- Take the next sequence slot of the new millisecond, as park.lua does,
-- after the entries there other than this one (read before the move).
local lo = due_ms * 1024
local top = redis.call('ZREVRANGEBYSCORE', due, lo + 1023, lo, 'WITHSCORES', 'LIMIT', 0, 2)
local last = top[2]
if top[1] == id then last = top[4] end
local score = lo
if last then score = math.min(tonumber(last) + 1, lo + 1023) end
zdelay_t_reschedule({due = due}, id, from, score)
-- A held entry may come back to an empty due set: then it is the earliest.
if not before or score < before then
  zdelay_wake(ARGV[1], due_ms)
end
return due_ms
