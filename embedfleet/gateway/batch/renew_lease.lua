-- Renew a lease only if it is still ours: one that expired and was taken by another replica
-- stays theirs (the caller learns it lost the lease, and its fenced writes will be refused).
-- KEYS[1] the lease key
-- ARGV[1] the holder's token; ARGV[2] the lease's new lifetime in milliseconds
-- Returns 1 when renewed, 0 when the lease was no longer ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 0
