-- Enqueue chunks of one job and count each once (producer/enqueue.py says why).
-- KEYS[1] the ingest stream; KEYS[2] the job's counters (hash); KEYS[3] the job's id record
--   (hash: chunk id -> digest of the payload last enqueued under it)
-- ARGV[1] seconds the id record lives after the job's latest enqueue (0: for ever), then one
--   (chunk id, payload digest, payload) triple per chunk
-- Returns how many entries were added (a chunk re-sent with the same payload adds none).
local added = 0
for i = 2, #ARGV, 3 do
  if redis.call('HGET', KEYS[3], ARGV[i]) ~= ARGV[i + 1] then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    redis.call('XADD', KEYS[1], '*', 'm', ARGV[i + 2])
    added = added + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'enqueued', added) end
local ttl = tonumber(ARGV[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
return added
