-- Take concurrency slots for tasks about to be released: at most *limit* live at once.
--
-- The slots record is the only key this touches, and has a hash tag of its
-- own (as a token bucket): on a Redis Cluster it sits on one node, whatever
-- node the shards are on. Several companions call this at once; the script
-- is atomic, so the record never holds more than *limit* live slots.
-- A task that took a slot already (its retry, a second release of the same
-- id) keeps it, its end moved: it takes no second one. A slot whose end has
-- passed (a worker that died without saying the task ended) is free again.
--
-- KEYS[1] slots zset    task id -> ms (Redis clock) its slot ends by itself
-- ARGV[1] limit: most live slots
-- ARGV[2] max run ms: how long a slot lasts when no worker frees it
-- ARGV[3..] task ids, in release order
-- returns the ids granted a slot, in the order given
if redis.replicate_commands then redis.replicate_commands() end

local slots = KEYS[1]
local limit, max_run_ms = zdelay_number(ARGV[1]), zdelay_number(ARGV[2])
if not limit or not max_run_ms or limit < 1 or max_run_ms < 1 then
  error({err = 'ERR celery-zdelay take_slots: limit and max run ms must be positive numbers'})
end
zdelay_expect(slots, 'zset')
local now_ms = zdelay_now_ms()
local ends = now_ms + max_run_ms

local live = redis.call('ZCOUNT', slots, '(' .. string.format('%.0f', now_ms), '+inf')
local granted = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', slots, id)
  if score and tonumber(score) > now_ms then
    granted[#granted + 1] = id
  elseif live < limit then
    live = live + 1
    granted[#granted + 1] = id
  end
end

-- Writes: the ended slots go, the granted ones are (re)written.
redis.call('ZREMRANGEBYSCORE', slots, '-inf', string.format('%.0f', now_ms))
for _, id in ipairs(granted) do
  redis.call('ZADD', slots, string.format('%.0f', ends), id)
end
if #granted > 0 then
  -- The record ends with its last slot: nothing stays of a key left idle.
  local last = redis.call('ZRANGE', slots, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', slots, last[2])
end
return granted
