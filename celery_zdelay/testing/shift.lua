-- Move every parked entry of a shard earlier: time passes for what is parked.
--
-- Only celery_zdelay.testing runs this, to fast-forward a test's clock. The
-- score keeps its same-millisecond sequence (the low 10 bits), so the order
-- of entries is unchanged; entries in flight are not touched. A debounce's
-- burst started as much earlier too (its record's "f" field, see
-- celery_zdelay/store/lua/_marks.lua), so its max_wait cap comes as much
-- sooner, as it would in the time the test simulates.
--
-- KEYS[1] due zset   id -> due_ms * 1024 + seq
-- KEYS[2] marks hash (optional) "i:<id>"/"d:<id>" -> record
-- ARGV[1] ms to move every entry earlier (a positive integer)
-- returns the number of entries moved
local due = KEYS[1]
local delta_ms = tonumber(ARGV[1])
local delta = delta_ms * 1024
local entries = redis.call('ZRANGE', due, 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  redis.call('ZADD', due, tonumber(entries[i + 1]) - delta, entries[i])
end
local marks = KEYS[2]
if marks and redis.call('TYPE', marks)['ok'] == 'hash' then
  -- Read whole, then written: a test's store is small, and a scan of a hash
  -- being written could visit a field twice.
  local fields = redis.call('HGETALL', marks)
  local moved = {}
  for i = 1, #fields, 2 do
    local record = fields[i + 1]
    local nl = string.find(record, '\n', 1, true) or (#record + 1)
    local head = string.sub(record, 1, nl - 1)
    local earlier, found = string.gsub(head, ' f(%d+)', function(first)
      return ' f' .. string.format('%.0f', math.max(tonumber(first) - delta_ms, 0))
    end)
    if found > 0 then moved[#moved + 1] = {fields[i], earlier .. string.sub(record, nl)} end
  end
  for _, pair in ipairs(moved) do redis.call('HSET', marks, pair[1], pair[2]) end
end
return #entries / 2
