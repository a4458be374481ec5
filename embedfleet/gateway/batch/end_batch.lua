-- End a Batch API batch (completed, failed, expired or cancelled) only if the caller still
-- holds its lease: the fencing step. A replica whose lease expired while it wrote the output
-- (a pause longer than the lease) finds another token here and ends nothing, so the batch is
-- ended once, by one replica, with one output file.
-- KEYS[1] the batch's lease; KEYS[2] the batch's hash; KEYS[3] the set of active batches;
--   KEYS[4] the owner's set of active batches
-- ARGV[1] the lease token the caller holds; ARGV[2] the final Batch object (JSON);
--   ARGV[3] the batch id
-- Returns 1 when ended, 0 when the lease was no longer the caller's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'object', ARGV[2])
redis.call('SREM', KEYS[3], ARGV[3])
redis.call('SREM', KEYS[4], ARGV[3])
return 1
