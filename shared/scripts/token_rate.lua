-- A tenant's token rate over its lane, one for the whole fleet (EMBEDFLEET_TENANT_TOKEN_RATE):
-- a token bucket in one hash, refilled at the rate by the server's clock (one clock for every
-- worker, whatever theirs say), holding at most `capacity` tokens, and allowed to go into debt.
-- A worker reserves what a read may take before it reads (entries at the tokens per entry it
-- has seen of the tenant) and settles with its next call: what the entries it read cost, less
-- what it reserved (more: debt, which the rate repays before anyone reads the tenant again;
-- less, or entries reserved but not read: given back). So the fleet's reads hold the rate
-- however many workers share it, to within one read's estimate per worker.
-- An absent bucket holds `start` tokens (less than the capacity: a tenant idle a while, whose
-- bucket expired, starts with a short burst, not the whole bucket).
-- KEYS[1] the tenant's bucket (hash: `tokens`, `at_us`)
-- ARGV[1] the rate, tokens per second; ARGV[2] the capacity, tokens; ARGV[3] start, tokens
-- ARGV[4] tokens to settle: read since the caller's last call less what it reserved (may be < 0)
-- ARGV[5] tokens per entry (0: entries that cost nothing, as far as the caller knows)
-- ARGV[6] the most entries the caller wants (0: settle only)
-- Returns {entries granted, tokens reserved for them, tokens left (negative: debt)}, the two
-- token counts as strings (they are fractional).
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local start = tonumber(ARGV[3])
local settle = tonumber(ARGV[4])
local per_entry = tonumber(ARGV[5])
local wanted = tonumber(ARGV[6])
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at_us')
local tokens = tonumber(state[1]) or start
local at_us = tonumber(state[2]) or now_us
tokens = math.min(capacity, tokens + math.max(0, now_us - at_us) * rate / 1000000) - settle
local granted = 0
if wanted > 0 and tokens > 0 then
  if per_entry <= 0 then
    granted = wanted
  elseif per_entry <= capacity then
    granted = math.min(wanted, math.floor(tokens / per_entry))
  elseif tokens >= capacity then
    -- an entry over the whole bucket is read once the bucket is full: the tenant progresses,
    -- and its debt holds it the time its entry's tokens take at the rate
    granted = 1
  end
end
local reserved = granted * per_entry
tokens = tokens - reserved
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at_us', tostring(now_us))
-- kept until it is full again and as long again as a full bucket takes to fill: a tenant whose
-- entries each cost more than the capacity is read when it is full, and a reader busy with
-- other tenants meanwhile still finds it full, not started again
redis.call('PEXPIRE', KEYS[1], math.ceil((2 * capacity - tokens) * 1000 / rate))
return {granted, tostring(reserved), tostring(tokens)}
