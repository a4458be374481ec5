-- Enqueue chunks of one job and count each once (producer/enqueue.py says why), within the
-- tenant's backlog limit.
-- KEYS[1] the ingest stream (one tenant's, in one partition); KEYS[2] the job's counters (hash);
--   KEYS[3] the job's id record (hash: chunk id -> 8-byte digest of the payload last enqueued
--   under it, then the 8-byte token of the enqueue batch that added it). Chunks without a job:
--   KEYS[1] only, each chunk added (nothing records or counts them).
-- ARGV[1] seconds the id record lives after the job's latest enqueue (0: for ever);
--   ARGV[2] this enqueue batch's token; ARGV[3] "1" to add ids the job already has (force);
--   ARGV[4] entries the stream may hold at most (the tenant's share of
--   EMBEDFLEET_TENANT_MAX_BACKLOG in this partition; -1: no limit), checked here, per entry,
--   so concurrent producers cannot pass it; then one (chunk id, payload digest, payload)
--   triple per chunk. Without ARGV[4] (the triples then start at ARGV[4]: the layout before
--   the limit, which clients in other languages may still send; the count of ARGV tells the
--   two apart), no limit.
-- Returns {added, again, handled}: entries added now; chunks this same batch had already added
-- (a re-send after a lost reply); and how many of the chunks, from the first, were dealt with:
-- the script stops at the first chunk that needs room the stream does not have, and the caller
-- sends the rest again once there is room. Of the handled chunks, those neither added nor
-- again were in the job before (or are a repeat, in this call, of an id with the same payload),
-- and were skipped.
local added, again, handled = 0, 0, 0
local token, force = ARGV[2], ARGV[3] == '1'
local limit, first = -1, 4
if (#ARGV - 4) % 3 == 0 then limit, first = tonumber(ARGV[4]), 5 end
local job = #KEYS == 3
local held = 0
if limit >= 0 then held = redis.call('XLEN', KEYS[1]) end
local here = {}  -- id -> digest of what this call wrote or found as its own: a repeat is skipped
for i = first, #ARGV, 3 do
  local id, digest = ARGV[i], ARGV[i + 1]
  local add = true
  if job then
    if here[id] == digest then
      add = false
    else
      local seen = redis.call('HGET', KEYS[3], id)
      local same = seen and string.sub(seen, 1, 8) == digest
      if same and string.sub(seen, 9) == token then
        again = again + 1
        here[id] = digest
        add = false
      elseif same and not force then
        add = false
      end
    end
  end
  if add then
    if limit >= 0 and held >= limit then break end
    if job then
      redis.call('HSET', KEYS[3], id, digest .. token)
      here[id] = digest
    end
    redis.call('XADD', KEYS[1], '*', 'm', ARGV[i + 2])
    added = added + 1
    held = held + 1
  end
  handled = handled + 1
end
if job then
  if added > 0 then redis.call('HINCRBY', KEYS[2], 'enqueued', added) end
  local ttl = tonumber(ARGV[1])
  if ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
end
return {added, again, handled}
