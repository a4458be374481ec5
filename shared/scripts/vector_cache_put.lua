-- Store vectors in one key set's vector cache and keep it within its bound (issue 31).
-- KEYS[1] the cache (hash: content key -> packed entry); KEYS[2] its use order (sorted set:
--   content key -> last use, unix ms); KEYS[3] its counters (hash: bytes, evicted, ...)
-- ARGV[1] now (unix ms); ARGV[2] this key set's bound in bytes; ARGV[3] the idle TTL (ms);
--   then one (content key, packed entry) pair per vector
-- An entry's size counts its key twice (the hash field and the set member), its value and 64
-- bytes of Redis overhead. Entries idle past the TTL go first (at most 1000 per call), then the
-- least recently used, one at a time, until the bytes held fit the bound. The bound is this
-- script's own, not the server's maxmemory policy: on a shared server that would evict other
-- tenants' keys (or the queue's) before the cache's.
-- Returns the number of entries evicted.
local function size(key, length) return 2 * #key + length + 64 end
local now, bound, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local held = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0') or 0
if redis.call('EXISTS', KEYS[1]) == 0 then held = 0 end
for i = 4, #ARGV, 2 do
  local key, value = ARGV[i], ARGV[i + 1]
  local old = redis.call('HSTRLEN', KEYS[1], key)
  if old > 0 then held = held - size(key, old) end
  redis.call('HSET', KEYS[1], key, value)
  redis.call('ZADD', KEYS[2], now, key)
  held = held + size(key, #value)
end
local evicted = 0
local function evict(keys)
  for _, key in ipairs(keys) do
    local length = redis.call('HSTRLEN', KEYS[1], key)
    if length > 0 then held = held - size(key, length) end
    redis.call('HDEL', KEYS[1], key)
    redis.call('ZREM', KEYS[2], key)
    evicted = evicted + 1
  end
end
evict(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl, 'LIMIT', 0, 1000))
-- at most 1000 more than this call stores (a bound lowered a lot is reached over several calls,
-- so no one call blocks the server for long)
local budget = 1000 + (#ARGV - 3) / 2
while held > bound and budget > 0 do
  budget = budget - 1
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then
    held = 0
    break
  end
  evict(oldest)
end
if held < 0 then held = 0 end
redis.call('HSET', KEYS[3], 'bytes', held)
if evicted > 0 then redis.call('HINCRBY', KEYS[3], 'evicted', evicted) end
return evicted
