-- Enqueue chunks of one job and count each once (producer/enqueue.py says why).
-- KEYS[1] the ingest stream; KEYS[2] the job's counters (hash); KEYS[3] the job's id record
--   (hash: chunk id -> 8-byte digest of the payload last enqueued under it, then the 8-byte
--   token of the enqueue call that added it)
-- ARGV[1] seconds the id record lives after the job's latest enqueue (0: for ever);
--   ARGV[2] this enqueue call's token; ARGV[3] "1" to add ids the job already has (force),
--   then one (chunk id, payload digest, payload) triple per chunk
-- Returns {added, again}: entries added now, and chunks this same call had already added (a
--   re-send after a lost reply); the rest of the chunks were in the job before, and were skipped.
local added, again = 0, 0
local token, force = ARGV[2], ARGV[3] == '1'
for i = 4, #ARGV, 3 do
  local seen = redis.call('HGET', KEYS[3], ARGV[i])
  local same = seen and string.sub(seen, 1, 8) == ARGV[i + 1]
  if same and string.sub(seen, 9) == token then
    again = again + 1
  elseif force or not same then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1] .. token)
    redis.call('XADD', KEYS[1], '*', 'm', ARGV[i + 2])
    added = added + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'enqueued', added) end
local ttl = tonumber(ARGV[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[3], ttl) end
return {added, again}
