-- Save fields of a Batch API batch's hash only if the caller still holds its lease: a replica
-- whose lease expired mid-step must not write a state (say, "finalizing") over the one the
-- lease's new holder has reached since, which could leave an ended batch looking active.
-- KEYS[1] the batch's lease; KEYS[2] the batch's hash
-- ARGV[1] the lease token the caller holds; then the fields, name and value in turn
-- Returns 1 when saved, 0 when the lease was no longer the caller's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
return 1
