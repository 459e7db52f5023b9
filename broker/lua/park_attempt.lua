-- park_attempt: an attempt whose tool calls wait for a person lets go of its turn.
--
-- No worker, task or connection waits for a person: the turn's status becomes
-- `awaiting_approval` (not at rest: readers stay attached, no `end` is written), the attempt's
-- record keeps what it needs to go on (its `parked` state) and its text so far, and the lease is
-- dropped. The job is settled by its worker; decide_approval.lua queues the turn again once the
-- last of its approvals is decided. If every approval was decided meanwhile, or a stop was
-- requested, nothing changes and the caller goes on (or stops) itself.
--
-- KEYS[1]  turn hash       {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  lease hash      {c:<conversation>}:lease:<turn_id>
-- KEYS[3]  waiting set     {c:<conversation>}:approvals-waiting:<turn_id>
-- KEYS[4], KEYS[5], ...    the approval hashes the attempt waits for
-- ARGV[1]  token           the fencing token returned by claim_lease
-- ARGV[2]  attempt         the attempt being parked
-- ARGV[3]  record          JSON of the attempt's record, its `parked` state included
-- ARGV[4]  text            the attempt's text so far
-- ARGV[5], ARGV[6], ...    the approval ids, in the order of KEYS[4], ...
--
-- Returns  {"parked", n}    the turn waits for n approvals
--          {"decided"}      none of them waits any more: nothing changed, go on
--          {"stop"}         a stop was requested: nothing changed, end the attempt cancelled
--          A park sent again after its reply was lost answers "parked" again.
-- Errors   "FENCED ..."     the lease expired or belongs to another token; nothing changed
local turn, lease, waiting = KEYS[1], KEYS[2], KEYS[3]
local l = redis.call('HMGET', lease, 'token', 'cancel')
if l[1] ~= ARGV[1] then
  local v = redis.call('HMGET', turn, 'fence', 'attempt', 'status')
  if v[1] == ARGV[1] and v[2] == ARGV[2] and v[3] == 'awaiting_approval' then
    return {'parked', redis.call('SCARD', waiting)}  -- our own park, sent again
  end
  return redis.error_reply('FENCED lease lost or taken over')
end
if l[2] then
  return {'stop'}
end
redis.call('DEL', waiting)
for i = 4, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'decision') == 0 then
    redis.call('SADD', waiting, ARGV[i + 1])
  end
end
local n = redis.call('SCARD', waiting)
if n == 0 then
  return {'decided'}
end
redis.call('HSET', turn, 'status', 'awaiting_approval', 'attempt:' .. ARGV[2], ARGV[3],
  'text:' .. ARGV[2], ARGV[4])
redis.call('DEL', lease)
return {'parked', n}
