-- Shared by handoff.lua and push.lua, which are loaded with this file in
-- front: read an entry and rebuild the envelope head a release publishes.
-- (The entry format is described in celery_zdelay/entry.py.)

-- Template records of this call, parsed once each: tid -> record or false.
local zdelay_templates = {}

local function zdelay_template(templates_key, tid)
  local cached = zdelay_templates[tid]
  if cached ~= nil then return cached end
  cached = false
  local record = redis.call('HGET', templates_key, tid)
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
      cached = {pieces = pieces, numbers = numbers, count = meta.c, k = meta.k, l = meta.l}
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

