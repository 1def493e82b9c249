-- Delete the history records that expired (see _history.lua): one bounded
-- step of a scan of the history hash, so a companion's sweep never blocks
-- Redis for long. A record expires *keep ms* after its last line's time;
-- reads already ignore an expired one: this only frees its memory.
--
-- KEYS[1] history hash  id -> event lines
-- ARGV[1] HSCAN cursor ("0" starts a scan)
-- ARGV[2] fields to look at in this step (HSCAN COUNT)
-- ARGV[3] keep ms: zdelay_history_seconds in ms (0: every record has expired)
-- returns {next cursor ("0": the scan is over), number of records deleted}
if redis.replicate_commands then redis.replicate_commands() end
local hist = KEYS[1]
zdelay_expect(hist, 'hash')
local keep_ms = zdelay_number(ARGV[3])
if not keep_ms or keep_ms < 0 then
  error({err = 'ERR celery-zdelay history_sweep: the keep time is not a number of ms'})
end
local until_ms = zdelay_now_ms() - keep_ms
local reply = redis.call('HSCAN', hist, ARGV[1], 'COUNT', tonumber(ARGV[2]))
local pairs_, expired = reply[2], {}
for i = 1, #pairs_, 2 do
  -- The time of its last line: the digits after the last line's code and tab.
  local last_at = tonumber(string.match(pairs_[i + 1], '\t(%d+)[^\n]*$'))
  if not last_at or last_at <= until_ms then expired[#expired + 1] = pairs_[i] end
end
if #expired > 0 then redis.call('HDEL', hist, unpack(expired)) end
return {reply[1], #expired}
