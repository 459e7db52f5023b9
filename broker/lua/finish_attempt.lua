-- finish_attempt: end an attempt atomically: its last events, the turn's status, the attempt's
-- record and text, the release of the lease and the retention clock, all in one step, so a reader
-- that sees the `end` event also sees the turn at rest.
--
-- KEYS[1]  turn hash      {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  lease hash     {c:<conversation>}:lease:<turn_id>
-- KEYS[3]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[4]  tombstone      {c:<conversation>}:tombstone:<turn_id>
-- ARGV[1]  token          the fencing token returned by claim_lease
-- ARGV[2]  attempt        the attempt number being finished
-- ARGV[3]  turn status    complete | interrupted | cancelled | failed
-- ARGV[4]  record         JSON of the attempt (n, strategy, status, reason)
-- ARGV[5]  text           the attempt's assembled text
-- ARGV[6]  ttl_ms         retention of the finished turn's keys
-- ARGV[7]  tombstone_ms   how long the turn id stays taken (and answers "expired") after that
-- ARGV[8], ARGV[9], ...   pairs of (event type, JSON data); the last is the `end` event.
--                         Not counted against max_events: the terminal sentinel always fits.
--
-- Returns  the list of assigned entry ids
-- Errors   "FENCED ..."  the lease expired or belongs to another token; nothing changed
local turn, lease, events, tombstone = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost or taken over')
end
local ids = {}
for i = 8, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', events, '*', 'e', ARGV[i], 'd', ARGV[i + 1])
end
local n = ARGV[2]
redis.call('HSET', turn, 'status', ARGV[3], 'attempt:' .. n, ARGV[4], 'text:' .. n, ARGV[5])
if ARGV[3] == 'complete' then
  redis.call('HSET', turn, 'canonical', n)
end
redis.call('DEL', lease)
redis.call('PEXPIRE', turn, ARGV[6])
redis.call('PEXPIRE', events, ARGV[6])
redis.call('SET', tombstone, n, 'PX', tonumber(ARGV[6]) + tonumber(ARGV[7]))
return ids
