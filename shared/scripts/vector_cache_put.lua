-- Store vectors in one key set's vector cache and keep it within its bound (issue 31).
-- KEYS[1] the cache (hash: content key -> packed entry); KEYS[2] its use order (sorted set:
--   content key -> last use, unix ms); KEYS[3] its counters (hash: bytes, evicted, ...)
-- ARGV[1] now (unix ms); ARGV[2] this key set's bound in bytes; ARGV[3] the idle TTL (ms);
--   then one (content key, packed entry) pair per vector
-- An entry's size is what Redis allocates for it (issue 40: counting only its key twice, its
-- value and 64 bytes let the cache's keys take 1.16x the bound, by MEMORY USAGE, on Redis 7.0):
-- its value and its key (the hash's field) as strings, its key again (the use order's member),
-- a dict entry in the hash and one in the use order's dict, a skip list node, and its share of
-- the two dicts' bucket arrays, each allocation rounded up to jemalloc's size classes (Redis's
-- allocator). That is an upper bound of what Redis 7 and Valkey take; the server's own report
-- (MEMORY USAGE, sampled) guards another allocator or version: when it says more, the bound is
-- kept on its figure (the count kept in KEYS[3] stays the script's own). Entries idle past the TTL go first (at most 1000 per call), then the
-- least recently used, one at a time, until the bytes held fit the bound. The bound is this
-- script's own, not the server's maxmemory policy: on a shared server that would evict other
-- tenants' keys (or the queue's) before the cache's.
-- Returns the number of entries evicted.
local function allocated(n)  -- jemalloc's size class for n bytes
  if n <= 8 then return 8 end
  if n <= 128 then return math.ceil(n / 16) * 16 end
  -- four classes per doubling above 128: (group, 2 * group] in steps of group / 4
  local group = 128
  while group * 2 < n do group = group * 2 end
  local step = group / 4
  return math.ceil(n / step) * step
end
local function string_size(length)  -- an sds string: its header and the terminating NUL
  if length < 256 then return allocated(length + 4) end
  if length < 65536 then return allocated(length + 6) end
  return allocated(length + 10)
end
-- dict entries (24 bytes: 32 allocated) in the hash and the use order's dict, a skip list node
-- (40 bytes and 16 a level: 64 covers the mean of its random levels with room), and up to two
-- 8-byte bucket slots an entry in each dict (a dict doubles when full)
local PER_ENTRY = 2 * 32 + 64 + 2 * 2 * 8
-- (the three keys' fixed parts, a few hundred bytes, are covered by the entries' rounding at
-- any bound of 1 MB or more)
local function size(key, length) return string_size(length) + 2 * string_size(#key) + PER_ENTRY end
-- how many elements MEMORY USAGE samples to estimate each key (O(samples), not O(entries))
local SAMPLES = 32
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
-- the server's own figure: evict on it too when it is above the count (not expected with
-- jemalloc; another allocator or a future layout may take more). It is sampled, so the guard
-- keeps it to 99% of the bound, and measures again after each round (bucket arrays do not
-- shrink as entries go: an entry frees a little less than the mean).
-- A server that refuses MEMORY (renamed, or not in the ACL user's rights) gives no figure: the
-- count alone bounds the cache there, and the store still works.
local function measured()
  local total = 0
  for k = 1, 2 do
    local usage = redis.pcall('MEMORY', 'USAGE', KEYS[k], 'SAMPLES', SAMPLES)
    if type(usage) == 'table' then return 0 end  -- an error reply
    total = total + (usage or 0)
  end
  return total
end
local used = held > 0 and measured() or 0
local rounds = 0
while used > held and used > 0.99 * bound and budget > 0 and rounds < 4 do
  rounds = rounds + 1
  local count = redis.call('HLEN', KEYS[1])
  if count == 0 then break end
  local per_entry = used / count
  while used > 0.99 * bound and budget > 0 do
    budget = budget - 1
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
    if #oldest == 0 then break end
    evict(oldest)
    used = used - per_entry
  end
  used = measured()
end
if held < 0 then held = 0 end
redis.call('HSET', KEYS[3], 'bytes', held)
if evicted > 0 then redis.call('HINCRBY', KEYS[3], 'evicted', evicted) end
return evicted
