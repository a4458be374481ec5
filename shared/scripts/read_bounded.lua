-- A worker's bulk read of one stream, bounded in payload bytes as well as in entries
-- (EMBEDFLEET_READ_MAX_BYTES): it looks at the entries a read would deliver (XRANGE after the
-- group's last delivered id, a page at a time) and delivers (XREADGROUP) only as many as fit
-- in `max_bytes`, or the first whatever its size, so a read never holds more than the bound
-- and one entry, however long the texts. Delivered as a plain XREADGROUP delivers them
-- (pending in the group, under this consumer). Needs Redis >= 6.2 (exclusive ranges).
-- KEYS[1] the stream
-- ARGV[1] the consumer group; ARGV[2] the consumer; ARGV[3] the most entries to read
-- ARGV[4] max_bytes: the most payload bytes to read; ARGV[5] the field that holds the payload
-- Returns the entries delivered, flat: {id, payload, id, payload, ...}, where an entry whose
-- only field is the payload's stands as its payload, and any other as its {field, value, ...}
-- (a copy's marker beside the payload, an entry without one). Flat, not XREADGROUP's
-- {{id, {field, value}}, ...}: two nested arrays an entry were most of the reply the worker
-- parses, thousands of entries a read on a GPU host (issue 53).
local count = tonumber(ARGV[3])
local max_bytes = tonumber(ARGV[4])
-- the entries after the group's last delivered id are those XREADGROUP '>' would deliver
local last = nil
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then last = fields['last-delivered-id'] end
end
if not last then
  return redis.error_reply('NOGROUP no consumer group ' .. ARGV[1] .. ' on ' .. KEYS[1])
end
-- a page at a time, so a read of short entries copies each once and a read of long ones
-- stops at the bound rather than copying every entry the count would allow
local page = 64
local fit = 0
local used = 0
local from = last
while fit < count do
  local asked = math.min(page, count - fit)
  local ahead = redis.call('XRANGE', KEYS[1], '(' .. from, '+', 'COUNT', asked)
  for _, entry in ipairs(ahead) do
    local size = 0
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == ARGV[5] then size = size + string.len(fields[i + 1]) end
    end
    if fit > 0 and used + size > max_bytes then
      count = fit -- the next entry would pass the bound: the read ends before it
      break
    end
    fit = fit + 1
    used = used + size
    from = entry[1]
  end
  if #ahead < asked then break end -- no more new entries
end
if fit == 0 then return {} end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', fit,
  'STREAMS', KEYS[1], '>')
if not reply then return {} end
local flat = {}
for _, entry in ipairs(reply[1][2]) do
  local fields = entry[2]
  flat[#flat + 1] = entry[1]
  if #fields == 2 and fields[1] == ARGV[5] then
    flat[#flat + 1] = fields[2]
  else
    flat[#flat + 1] = fields
  end
end
return flat
