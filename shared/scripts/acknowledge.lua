-- Acknowledge entries of one stream and, only for those this call really acknowledged, delete
-- them, count them for their job and hand their answer on: RPUSH it to the caller's reply list,
-- or XADD it to the results stream. When a slow worker and the one that reclaimed its entries
-- both finish the same entry, the second XACK returns 0, so the job counter and the answer see
-- the entry once. Deleting only acknowledged entries keeps the group's lag exact (KEDA reads it).
-- KEYS[1] the stream the entries were read from; KEYS[2] the results stream of its key set
-- ARGV[1] the consumer group; ARGV[2] the job counter to count in (done, dead); ARGV[3] the
--   job-key prefix; ARGV[4] the reply-key prefix; ARGV[5] a reply list's lifetime in seconds;
--   then four per entry: entry id, job ('' for none), reply ('' for none: the answer, if any,
--   goes to the results stream), answer payload ('' for none)
-- Job and reply keys are built from the prefixes: they share the stream's hash tag, so the call
-- stays in one slot on a cluster. Returns how many entries this call acknowledged.
local acked = 0
for i = 6, #ARGV, 4 do
  local entry = ARGV[i]
  if redis.call('XACK', KEYS[1], ARGV[1], entry) == 1 then
    redis.call('XDEL', KEYS[1], entry)
    if ARGV[i + 1] ~= '' then redis.call('HINCRBY', ARGV[3] .. ARGV[i + 1], ARGV[2], 1) end
    if ARGV[i + 2] ~= '' then
      local reply = ARGV[4] .. ARGV[i + 2]
      redis.call('RPUSH', reply, ARGV[i + 3])
      redis.call('EXPIRE', reply, tonumber(ARGV[5]))
    elseif ARGV[i + 3] ~= '' then
      redis.call('XADD', KEYS[2], '*', 'm', ARGV[i + 3])
    end
    acked = acked + 1
  end
end
return acked
