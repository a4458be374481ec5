-- Release a lease only if it is still ours: it may have expired and been taken by another.
-- KEYS[1] the lease key
-- ARGV[1] the holder's token
-- Returns 1 when released, 0 when the lease was no longer ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
