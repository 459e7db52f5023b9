-- cancel_turn: the stop button. A queued attempt is ended here and now; a running one gets a
-- durable stop flag that its worker sees (notified at once, or at its next append or heartbeat).
--
-- KEYS[1]  turn hash      {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[3]  tombstone      {c:<conversation>}:tombstone:<turn_id>
-- KEYS[4]  conversation turns  {c:<conversation>}:turns
-- KEYS[5]  lease hash     {c:<conversation>}:lease:<turn_id> (flagged too, so that an append
--                         reads one hash; a takeover's claim copies the turn's flag)
-- ARGV[1]  ttl_ms         retention of the finished turn's keys
-- ARGV[2]  tombstone_ms   how long the turn id stays taken after that
--
-- An attempt parked on approvals (`awaiting_approval`) has no worker either: it is ended here
-- too, its text kept (its approvals are decided `stop` by the caller first).
--
-- Returns  {"cancelled", attempt}   a queued or parked attempt was ended (its end written)
--          {"signalled", attempt}   a running attempt was asked to stop
--          {"final", status}        the turn was already at rest: nothing changed
--          {"missing"}              no such turn
-- Errors   none of its own.
local turn, events = KEYS[1], KEYS[2]
local v = redis.call('HMGET', turn, 'status', 'attempt')
local status, attempt = v[1], v[2]
if not status then
  return {'missing'}
end
if status == 'streaming' then
  redis.call('HSET', turn, 'cancel', attempt)
  if redis.call('EXISTS', KEYS[5]) == 1 then
    redis.call('HSET', KEYS[5], 'cancel', attempt)
  end
  return {'signalled', attempt}
end
if status ~= 'queued' and status ~= 'awaiting_approval' then
  return {'final', status}
end
-- No worker has it (yet, or while it waits): no writer to fence, so the stop is written here.
local record = cjson.decode(redis.call('HGET', turn, 'attempt:' .. attempt))
record['status'] = 'cancelled'
record['reason'] = 'cancelled'
record['parked'] = nil
local n = tonumber(attempt)
local text = ''
if status == 'queued' and not redis.call('HGET', turn, 'text:' .. attempt) then
  redis.call('XADD', events, '*', 'e', 'attempt', 'd',
    cjson.encode({attempt = n, strategy = record['strategy']}))
else
  text = redis.call('HGET', turn, 'text:' .. attempt) or ''
end
redis.call('XADD', events, '*', 'e', 'end', 'd',
  cjson.encode({attempt = n, status = 'cancelled', reason = 'cancelled'}))
redis.call('HSET', turn, 'status', 'cancelled', 'attempt:' .. attempt, cjson.encode(record),
  'text:' .. attempt, text)
local ttl = tonumber(ARGV[1])
redis.call('PEXPIRE', turn, ttl)
redis.call('PEXPIRE', events, ttl)
redis.call('SET', KEYS[3], attempt, 'PX', ttl + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[4], ttl + tonumber(ARGV[2]))
return {'cancelled', attempt}
