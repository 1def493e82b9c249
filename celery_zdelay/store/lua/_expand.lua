-- Loaded in front of handoff.lua: read an entry and build the message a
-- release pushes. (The entry format is described in celery_zdelay/entry.py.)

-- Template records of this call, parsed once each: tid -> record or false.
local zdelay_templates = {}

local function zdelay_template(templates_key, tid)
  local cached = zdelay_templates[tid]
  if cached ~= nil then return cached end
  cached = false
  local record = redis.call('HGET', templates_key, tid)
  -- A template id is the hash of its record (entry.py): a record that does
  -- not hash to it was rewritten by someone else, and counts as missing.
  if record and string.sub(redis.sha1hex(record), 1, 16) ~= tid then record = nil end
  local nl = record and string.find(record, '\n', 1, true)
  if nl then
    local ok, meta = pcall(cjson.decode, string.sub(record, 1, nl - 1))
    if ok and type(meta) == 'table' and type(meta.c) == 'number' then
      -- Split the text at its NUL markers once: literal pieces and the
      -- number of the value that follows each.
      local text, pieces, numbers, pos = string.sub(record, nl + 1), {}, {}, 1
      while true do
        local z = string.find(text, '\0', pos, true)
        if not z then break end
        pieces[#pieces + 1] = string.sub(text, pos, z - 1)
        numbers[#numbers + 1] = string.byte(text, z + 1)
        pos = z + 2
      end
      pieces[#pieces + 1] = string.sub(text, pos)
      local fits = meta.c >= 1 and meta.c <= 255 and string.sub(pieces[1], 1, 8) == '{"body":'
      for _, number in ipairs(numbers) do
        if number < 1 or number > meta.c then fits = false end
      end
      if fits then
        -- sfmt: struct.unpack's format for the entry's values, each ending in a NUL.
        cached = {pieces = pieces, numbers = numbers, count = meta.c, k = meta.k, l = meta.l,
                  sfmt = string.rep('s', meta.c), tid = tid}
      end
    end
  end
  zdelay_templates[tid] = cached
  return cached
end

-- Returns meta (the decoded first line) and the envelope head of a payload,
-- or nil when the payload is missing, foreign, damaged or of another version.
local function zdelay_read(templates_key, payload)
  if not payload then return nil end
  local nl = string.find(payload, '\n', 1, true)
  if not nl then return nil end
  local ok, meta = pcall(cjson.decode, string.sub(payload, 1, nl - 1))
  if not ok or type(meta) ~= 'table' or meta.v ~= 1 or #payload - nl ~= meta.n then
    return nil
  end
  local head
  if type(meta.t) == 'string' then
    local template = zdelay_template(templates_key, meta.t)
    if not template then return nil end
    local values, pos = {}, nl + 1
    while true do
      local z = string.find(payload, '\0', pos, true)
      if not z then break end
      values[#values + 1] = string.sub(payload, pos, z - 1)
      pos = z + 1
    end
    values[#values + 1] = string.sub(payload, pos)
    if #values ~= template.count then return nil end
    local parts = {}
    for i, piece in ipairs(template.pieces) do
      parts[#parts + 1] = piece
      local number = template.numbers[i]
      if number then
        local value = values[number]
        if not value then return nil end
        parts[#parts + 1] = value
      end
    end
    head = table.concat(parts)
    meta.k, meta.l = template.k, template.l
  else
    head = string.sub(payload, nl + 1)
  end
  -- A cheap sanity check of the envelope; anything odd goes to the
  -- companion, which reads it fully and dead-letters what is damaged.
  if string.sub(head, 1, 9) ~= '{"body":"' then return nil end
  return meta, head
end


-- The template of an entry in the exact unsigned form entry.py writes
-- ({"v":1,"t":"<id>","n":<n>}, a newline, values each ending in a NUL),
-- with park.lua's parked-at stamp ({"p":<ms>,"v":1,...}) or without it
-- (parked by an earlier release), with a call's max_late after the stamp
-- ({"p":<ms>,"m":<ms>,"v":1,...}) or without it, and where its values start;
-- nil for any other form (read by zdelay_read).
local function zdelay_fast_entry(templates_key, payload)
  if not payload then return nil end
  local tid, n, pos = string.match(payload, '^{"p":%d+,"v":1,"t":"(%x+)","n":(%d+)}\n()')
  if not tid then
    tid, n, pos = string.match(payload, '^{"p":%d+,"m":%d+,"v":1,"t":"(%x+)","n":(%d+)}\n()')
  end
  if not tid then
    tid, n, pos = string.match(payload, '^{"v":1,"t":"(%x+)","n":(%d+)}\n()')
  end
  if not tid or #payload - pos + 1 ~= tonumber(n) or string.byte(payload, -1) ~= 0 then
    return nil
  end
  local template = zdelay_template(templates_key, tid)
  if not template then return nil end
  return template, pos
end

-- Route records of this call (entries stored whole): id -> {k, l, tid} or false.
local zdelay_routes = {}

-- The route record of an entry stored whole (zdelay_whole_messages: the
-- message exactly as it is pushed, its delivery tag naming the record; see
-- entry.py), given its id (zdelay_template_id); nil when the record is
-- missing or was rewritten by someone else.
local function zdelay_whole_route(templates_key, rid)
  local cached = zdelay_routes[rid]
  if cached ~= nil then return cached or nil end
  cached = false
  local record = redis.call('HGET', templates_key, rid)
  if record and string.sub(redis.sha1hex(record), 1, 16) == rid then
    -- One JSON line and its newline (entry.py): cjson reads the newline as
    -- trailing space, and anything after it as a record that is not ours.
    local ok, meta = pcall(cjson.decode, record)
    if ok and type(meta) == 'table' and meta.w == 1 then
      cached = {k = meta.k, l = meta.l, tid = rid}
    end
  end
  zdelay_routes[rid] = cached
  return cached or nil
end

-- One parts table reused for every message of the call: no table per entry.
local zdelay_parts = {}

-- The message of a zdelay_fast_entry entry, with *tail* (the delivery tag
-- and the closing '"}}') after the template's last piece; nil when the
-- values do not fit the template. The values are cut out in one C call
-- (struct.unpack of NUL-terminated strings) and joined in another.
local function zdelay_render(template, payload, pos, tail)
  local values = {pcall(struct.unpack, template.sfmt, payload, pos)}
  -- {true, value 1 .. value c, position after the last value}
  if not values[1] or values[template.count + 2] ~= #payload + 1 then return nil end
  local parts, pieces, numbers = zdelay_parts, template.pieces, template.numbers
  local m = #numbers
  for i = 1, m do
    parts[2 * i - 1] = pieces[i]
    parts[2 * i] = values[numbers[i] + 1]
  end
  parts[2 * m + 1] = pieces[m + 1]
  parts[2 * m + 2] = tail
  return table.concat(parts, '', 1, 2 * m + 2)
end

-- The eta of a release ahead (zdelay_release_ahead_seconds): *ms* (epoch
-- ms, UTC) in ISO 8601, as entry.eta_text writes it. Redis's Lua has no
-- os.date: days to a civil date by H. Hinnant's days_from_civil, inverted.
local function zdelay_iso(ms)
  local floor = math.floor
  local s = floor(ms / 1000)
  local frac, days = ms - s * 1000, floor(s / 86400)
  local secs = s - days * 86400
  local z = days + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local d = doy - floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03d000+00:00', y, m, d,
    floor(secs / 3600), floor(secs % 3600 / 60), secs % 60, frac)
end

-- *message* (a kombu envelope, whole or up to its delivery tag) with its
-- "eta" header set to *due_ms*, or nil when its headers do not start the
-- way Celery writes them. The same rule as entry.with_eta: the first
-- "eta":null after the envelope's "headers":{ (the body before it is
-- base64, the keys before it plain strings), preceded by "{" or "," (not a
-- key that ends in an escaped quote and eta), with no "{" or "[" between
-- (no nested value whose own key could be named eta).
local function zdelay_with_eta(message, due_ms)
  local _, hs = string.find(message, '"headers":{', 1, true)
  if not hs then return nil end
  local at = string.find(message, '"eta":', hs, true)
  if not at or string.sub(message, at + 6, at + 9) ~= 'null' then return nil end
  local before = string.byte(message, at - 1)
  if before ~= 123 and before ~= 44 then return nil end  -- '{' or ','
  if string.find(string.sub(message, hs + 1, at - 1), '[%[{]') then return nil end
  return string.sub(message, 1, at + 5) .. '"' .. zdelay_iso(due_ms) .. '"' .. string.sub(message, at + 10)
end
