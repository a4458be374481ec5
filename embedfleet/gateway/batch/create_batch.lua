-- Record a new Batch API batch for its owner, unless the owner already has its limit of active
-- batches: the count and the record are one step, so two creates racing on two gateway
-- replicas cannot both pass the limit.
-- KEYS[1] the batch's hash; KEYS[2] the index of every batch; KEYS[3] the set of active
--   batches; KEYS[4] the owner's index of batches; KEYS[5] the owner's set of active batches
-- ARGV[1] the batch id; ARGV[2] its creation time (the indexes' score); ARGV[3] the owner's
--   limit of active batches (0: none); then the hash's fields, name and value in turn
-- A member of the owner's active set that is no longer in the set of all active batches (its
-- record was removed by hand, say) is dropped before counting, so it never holds the limit.
-- Returns 1 when recorded, 0 when the owner is at its limit (nothing written).
local limit = tonumber(ARGV[3])
if limit > 0 then
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[5])) do
    if redis.call('SISMEMBER', KEYS[3], member) == 0 then redis.call('SREM', KEYS[5], member) end
  end
  if redis.call('SCARD', KEYS[5]) >= limit then return 0 end
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return 1
