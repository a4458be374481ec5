-- Replay one dead letter: write its payload back, move the job's count, delete the letter.
-- KEYS[1] the dead-letter stream; KEYS[2] the stream to replay onto; KEYS[3] the letter's
--   replay marker; KEYS[4] the job's counters, when the letter has a job (all of one partition)
-- ARGV[1] the dead entry's id; ARGV[2] the payload; ARGV[3] the replaying command's token;
--   ARGV[4] the marker's lifetime in seconds
-- Returns the new entry's id, or false when the letter is gone (replayed or purged by another
-- command). The marker makes a replay whose reply was lost safe to send again and exact to
-- report: the same command, finding the letter gone and its own token in the marker, gets back
-- the id it wrote.
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  local marker = redis.call('GET', KEYS[3])
  local mine = ARGV[3] .. ' '
  if marker and string.sub(marker, 1, #mine) == mine then return string.sub(marker, #mine + 1) end
  return false
end
local id = redis.call('XADD', KEYS[2], '*', 'm', ARGV[2])
if KEYS[4] then redis.call('HINCRBY', KEYS[4], 'dead', -1) end
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('SET', KEYS[3], ARGV[3] .. ' ' .. id, 'EX', ARGV[4])
return id
