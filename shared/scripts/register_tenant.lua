-- Register a named tenant's ingest stream in its key set before chunks are added to it: the
-- registry the workers read their streams from, and the consumer group, created at id 0 before
-- any entry so that nothing is skipped (the plain ingest stream's group is made by ensure_groups).
-- Sent in the same pipeline as the batch's XADDs, every batch: a Redis that lost the registry
-- (a restart without persistence) gets it back with the next batch.
-- KEYS[1] the key set's tenants registry (set); KEYS[2] the tenant's ingest stream
-- ARGV[1] the tenant's name; ARGV[2] the consumer group
-- Returns 1 when the tenant was new to the registry, else 0.
local added = redis.call('SADD', KEYS[1], ARGV[1])
local made = redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[2], '0', 'MKSTREAM')
if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP', 1, true) then
  return redis.error_reply(made.err)
end
return added
