-- The backlog of one key set (partition), every tenant's stream counted: what the high-water
-- mark, the tenants' limits and `embedfleet status` read (the registry and the lengths in one
-- call, one slot).
-- KEYS[1] the key set's tenants registry (set); KEYS[2] its plain ingest stream (the default
--   tenant's)
-- ARGV[1] the prefix of a named tenant's stream (`<prefix>:ingest:t:`, shared/keys.py)
-- Returns {total, '', default tenant's length, name1, length1, ...}: XLEN of every stream
-- (entries waiting or in flight), the default tenant's under the empty name.
local total = redis.call('XLEN', KEYS[2])
local reply = {0, '', total}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local length = redis.call('XLEN', ARGV[1] .. name)
  total = total + length
  reply[#reply + 1] = name
  reply[#reply + 1] = length
end
reply[1] = total
return reply
