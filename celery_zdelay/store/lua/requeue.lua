-- Put dead-lettered entries back, due now, with their original payload.
--
-- KEYS[1] dead zset     id -> dead-lettered at ms
-- KEYS[2] dead hash     id -> reason JSON "\n" payload
-- KEYS[3] due zset      id -> due_ms * 1024 + seq
-- KEYS[4] msg hash      id -> payload
-- KEYS[5] lease zset    id -> lease expiry ms (entries being released)
-- KEYS[6] marks hash    (optional, with KEYS[7]: keys and tags, see _marks.lua)
-- KEYS[7] tagged zset
-- ARGV[1] wake channel (best effort, after the writes: see zdelay_wake in _guard.lua)
-- ARGV[2..] ids
-- returns one flag per id: 1 requeued; 0 not dead-lettered, without payload,
--         or parked again under the same id (waiting, held back by a pause or
--         rate limit, or being released: see zdelay_where in _where.lua)
if redis.replicate_commands then redis.replicate_commands() end
local dead, dead_msg, due, msg, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local marks, tagged = KEYS[6], KEYS[7]
zdelay_expect(dead, 'zset', dead_msg, 'hash', due, 'zset', msg, 'hash', lease, 'zset')
local now_ms = zdelay_now_ms()
local place = {due = due, lease = lease, msg = msg}
local result = {}
local chosen, once = {}, {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local stored = redis.call('HGET', dead_msg, id)
  result[i - 1] = 0
  -- An id parked again since it died keeps its new entry, wherever it is:
  -- overwriting the payload of an in-flight entry would let its release
  -- acknowledge (delete) the requeued one, and a held one would be released
  -- with the old message while the new one was lost. An id given twice is
  -- requeued by its first mention (every read here comes before the writes:
  -- its second would take its key from the first and park it without).
  if stored and not once[id] and not zdelay_where(place, id) then
    local nl = string.find(stored, '\n', 1, true)
    local payload = nl and string.sub(stored, nl + 1) or ''
    if payload ~= '' then
      once[id] = true
      chosen[#chosen + 1] = {id, payload}
      result[i - 1] = 1
    end
  end
end
-- A requeued entry gets its tags back, and its key unless another entry
-- took the key meanwhile (that one keeps it; this one is parked without),
-- or an entry before it in this call takes it back: two dead letters of one
-- key requeued together leave one owner, as one after the other would.
-- One left with neither key nor tags gets no record, as any unmarked entry.
local restore, taken = {}, {}
if marks and #chosen > 0 and redis.call('EXISTS', marks) == 1 then
  zdelay_expect(marks, 'hash', tagged, 'zset')
  for _, entry in ipairs(chosen) do
    local record = redis.call('HGET', marks, 'd:' .. entry[1])
    if record then
      local _, _, key, tags = zdelay_mark_parse(record)
      local takes_key = false
      if key ~= '' then
        local owner, until_ms = zdelay_mark_owner(redis.call('HGET', marks, 'k:' .. key))
        takes_key = not taken[key] and (not owner or (until_ms ~= nil and until_ms <= now_ms))
        if takes_key then
          taken[key] = true
        elseif #tags > 0 then
          record = '-0\n'
          for _, tag in ipairs(tags) do record = record .. '\n' .. tag end
        else
          record = nil
        end
      end
      restore[#restore + 1] = {entry[1], record, takes_key and key or '', tags}
    end
  end
end
zdelay_t_requeue({dead = dead, dead_msg = dead_msg, due = due, msg = msg, marks = marks,
  tagged = tagged}, chosen, restore, now_ms * 1024)
if #chosen > 0 then zdelay_wake(ARGV[1], now_ms) end
return result
