-- A worker is about to run a periodic occurrence whose schedule has an
-- overlap policy (see celery_zdelay/periodic/overlap.py): take the
-- schedule's key as an until_finished key is held after its release, so
-- finish_key.lua frees it when the run ends and a run no worker reports
-- finished (a SIGKILLed worker) stops blocking when its hold ends.
--
-- KEYS[1] marks hash    (see _marks.lua): "k:<key>" holds "<id>\n<until ms>"
--                       while a run goes on, "b:<key>" the same for the one
--                       run waiting for it (buffer_one)
-- ARGV[1] key
-- ARGV[2] task id of the occurrence
-- ARGV[3] hold ms: how long the run holds the key at most
-- ARGV[4] "skip" or "buffer_one"
-- returns {"run"}: the key is this run's now
--         {"wait", holder}: buffer_one, and this run is the one waiting
--         {"skip", holder}: another run holds the key (and, for
--         buffer_one, another waits already)
local marks, key, id = KEYS[1], ARGV[1], ARGV[2]
zdelay_expect(marks, 'hash')
local now_ms = zdelay_now_ms()
local hold_ms = tonumber(ARGV[3])
local held, buffered = 'k:' .. key, 'b:' .. key
local function live(value)
  local holder, until_ms = zdelay_mark_holder(value)
  -- A holder without an end is a parked entry: not ours, but held all the same.
  if holder and holder ~= id and (until_ms == nil or until_ms > now_ms) then return holder end
  return nil
end
local ends = id .. '\n' .. string.format('%.0f', now_ms + hold_ms)
local holder = live(redis.call('HGET', marks, held))
if not holder then
  local was_waiting = zdelay_mark_holder(redis.call('HGET', marks, buffered)) == id
  zdelay_t_key_hold(marks, held, ends)
  if was_waiting then zdelay_t_key_free(marks, buffered) end
  return {'run'}
end
if ARGV[4] == 'buffer_one' and not live(redis.call('HGET', marks, buffered)) then
  zdelay_t_key_hold(marks, buffered, ends)
  return {'wait', holder}
end
return {'skip', holder}
