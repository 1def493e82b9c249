-- A worker is about to run a periodic occurrence whose schedule has an
-- overlap policy (see celery_zdelay/periodic/overlap.py): take the
-- schedule's key as an until_finished key stays taken after its release, so
-- finish_key.lua frees it when the run ends and a run no worker reports
-- finished (a SIGKILLed worker) stops blocking after max run ms.
--
-- KEYS[1] marks hash    (see _marks.lua): "k:<key>" is "<id>\n<until ms>"
--                       while a run goes on, "b:<key>" the same for the one
--                       run waiting for it (buffer_one)
-- ARGV[1] key
-- ARGV[2] task id of the occurrence
-- ARGV[3] max run ms: how long the run owns the key at most
-- ARGV[4] "skip" or "buffer_one"
-- returns {"run"}: the key is this run's now
--         {"wait", owner}: buffer_one, and this run is the one waiting
--         {"skip", owner}: another run owns the key (and, for
--         buffer_one, another waits already)
local marks, key, id = KEYS[1], ARGV[1], ARGV[2]
zdelay_expect(marks, 'hash')
local now_ms = zdelay_now_ms()
local max_run_ms = tonumber(ARGV[3])
local held, buffered = 'k:' .. key, 'b:' .. key
local function live(value)
  local owner, until_ms = zdelay_mark_owner(value)
  -- An owner without an end is a parked entry: not ours, but taken all the same.
  if owner and owner ~= id and (until_ms == nil or until_ms > now_ms) then return owner end
  return nil
end
local ends = id .. '\n' .. string.format('%.0f', now_ms + max_run_ms)
local owner = live(redis.call('HGET', marks, held))
if not owner then
  local was_waiting = zdelay_mark_owner(redis.call('HGET', marks, buffered)) == id
  zdelay_t_key_take(marks, held, ends)
  if was_waiting then zdelay_t_key_free(marks, buffered) end
  return {'run'}
end
if ARGV[4] == 'buffer_one' and not live(redis.call('HGET', marks, buffered)) then
  zdelay_t_key_take(marks, buffered, ends)
  return {'wait', owner}
end
return {'skip', owner}
