-- Acknowledge entries of one stream and, only for those this call really acknowledged, delete
-- them, count them for their job and hand their answer on: RPUSH it to the caller's reply list,
-- or XADD it to the results stream. When a slow worker and the one that reclaimed its entries
-- both finish the same entry, the second XACK returns 0, so the job counter and the answer see
-- the entry once. Deleting only acknowledged entries keeps the group's lag exact (KEDA reads it).
-- A job this call counted in that has now finished (done + dead >= enqueued) and whose counters
-- carry ids_ttl_after_done_s (EMBEDFLEET_JOB_IDS_FINISHED_TTL_S, set by the enqueue) gets its id
-- record expired that soon: a finished job's record does not stay for the full
-- EMBEDFLEET_JOB_IDS_TTL_S (the next enqueue to the job sets that again).
-- The same entries are counted for accounting (issue 30) in the key set's usage hash, so the
-- usage matches the job counters exactly: per (tenant, model, job) the counter as ``chunks``
-- (done), ``dead`` or ``expired``, and for embedded entries their ``tokens`` and ``model_us``
-- (microseconds of model time, the batch's shared by tokens). Fields are
-- ``<counter>|<tenant>|<model>|<job>`` (shared/keys.py Keys.usage), one HINCRBY per field.
-- KEYS[1] the stream the entries were read from; KEYS[2] the results stream of its key set;
--   KEYS[3] the key set's usage hash
-- ARGV[1] the consumer group; ARGV[2] the job counter to count in (done, dead); ARGV[3] the
--   job-key prefix; ARGV[4] the reply-key prefix; ARGV[5] a reply list's lifetime in seconds;
--   ARGV[6] the job-id-record prefix; ARGV[7] a msgpack array of eight values per entry: entry
--   id, job ('' for none), reply ('' for none: the answer, if any, goes to the results stream),
--   answer payload ('' for none), tenant ('' for the default), model name, tokens, model
--   microseconds. One argument for the batch, not eight per entry: packing thousands of
--   arguments one by one was the largest share of a GPU host's write (issue 53)
-- Job, id-record and reply keys are built from the prefixes: they share the stream's hash tag,
-- so the call stays in one slot on a cluster. Returns how many entries this call acknowledged.
local acked = 0
local jobs = {}
local counter = ARGV[2] == 'done' and 'chunks' or ARGV[2]
-- per '|tenant|model|job' of the entries acknowledged: entries, tokens and model microseconds,
-- added up here and written as one HINCRBY per field at the end (a batch has one or a few)
local usage = {}
local deleted = {}
local e = cmsgpack.unpack(ARGV[7])
for i = 1, #e, 8 do
  local entry = e[i]
  if redis.call('XACK', KEYS[1], ARGV[1], entry) == 1 then
    acked = acked + 1
    deleted[acked] = entry
    local job = e[i + 1]
    if job ~= '' then
      redis.call('HINCRBY', ARGV[3] .. job, ARGV[2], 1)
      jobs[job] = true
    end
    local owner = '|' .. e[i + 4] .. '|' .. e[i + 5] .. '|' .. job
    local sums = usage[owner]
    if not sums then
      sums = {0, 0, 0}
      usage[owner] = sums
    end
    sums[1] = sums[1] + 1
    sums[2] = sums[2] + math.max(tonumber(e[i + 6]) or 0, 0)
    sums[3] = sums[3] + math.max(tonumber(e[i + 7]) or 0, 0)
    if e[i + 2] ~= '' then
      local reply = ARGV[4] .. e[i + 2]
      redis.call('RPUSH', reply, e[i + 3])
      redis.call('EXPIRE', reply, tonumber(ARGV[5]))
    elseif e[i + 3] ~= '' then
      redis.call('XADD', KEYS[2], '*', 'm', e[i + 3])
    end
  end
end
-- deleted in one call (XDEL takes many ids), in slices under Lua's unpack limit
local slice = 4096
for first = 1, acked, slice do
  redis.call('XDEL', KEYS[1], unpack(deleted, first, math.min(first + slice - 1, acked)))
end
for owner, sums in pairs(usage) do
  redis.call('HINCRBY', KEYS[3], counter .. owner, sums[1])
  if sums[2] > 0 then redis.call('HINCRBY', KEYS[3], 'tokens' .. owner, sums[2]) end
  if sums[3] > 0 then redis.call('HINCRBY', KEYS[3], 'model_us' .. owner, sums[3]) end
end
for job in pairs(jobs) do
  local c = redis.call('HMGET', ARGV[3] .. job, 'enqueued', 'done', 'dead', 'ids_ttl_after_done_s')
  local ttl = tonumber(c[4])
  if ttl and (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0) >= (tonumber(c[1]) or 0) then
    local record = ARGV[6] .. job
    local left = redis.call('TTL', record)
    if left == -1 or left > ttl then redis.call('EXPIRE', record, ttl) end
  end
end
return acked
