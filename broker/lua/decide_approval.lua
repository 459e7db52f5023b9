-- decide_approval: the first decision on an approval wins (compare-and-set), from any device.
--
-- The decision is stored on the approval, the slot leaves `awaiting_approval` (approve: the
-- slot is `approved`, and the next claim_tool runs the call once; deny: it is `failed` with the
-- declined error, which every later claim replays; a stop: the slot is dropped, so that a
-- regenerate asks again), an `approval_decision` event goes on the turn's stream, and a turn
-- parked on its approvals is queued again once none of them waits.
--
-- KEYS[1]  approval hash   {c:<conversation>}:approval:<turn_id>:<approval_id>
-- KEYS[2]  slot hash       the approval's slot (its `slot` field)
-- KEYS[3]  turn hash       {c:<conversation>}:turn:<turn_id>
-- KEYS[4]  event stream    {c:<conversation>}:events:<turn_id>
-- KEYS[5]  waiting set     {c:<conversation>}:approvals-waiting:<turn_id> (what a parked
--                          attempt waits for: park_attempt.lua)
-- KEYS[6]  lease hash      {c:<conversation>}:lease:<turn_id> (while a writer holds it, its
--                          `base` counts the event appended here: see append_events.lua)
-- ARGV[1]  approval_id
-- ARGV[2]  decision        approve | deny
-- ARGV[3]  reason          "" for none
-- ARGV[4]  by              person | expiry | stop
-- ARGV[5]  now_ms          the approvals' clock now
-- ARGV[6]  denied error    JSON stored as the slot's error on deny (what the model is told)
--
-- Returns  {"decided", decision, reason, by, resumed, attempt}  this call decided; resumed is
--                          "1" when the turn was queued again (the caller enqueues its job)
--          {"stands", decision, reason, by}   an earlier decision stands: nothing changed
--          {"missing"}     no such approval (never, or expired with its turn)
-- Errors   none of its own.
local approval, slot, turn, events = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local a = redis.call('HMGET', approval, 'slot', 'decision', 'reason', 'by')
if not a[1] or a[1] ~= slot then
  return {'missing'}
end
if a[2] then
  return {'stands', a[2], a[3] or '', a[4] or ''}
end
local decision, reason, by = ARGV[2], ARGV[3], ARGV[4]
redis.call('HSET', approval, 'decision', decision, 'reason', reason, 'by', by,
  'decided_ms', ARGV[5])
local s = redis.call('HMGET', slot, 'state', 'approval_id')
if s[1] == 'awaiting_approval' and s[2] == ARGV[1] then
  if by == 'stop' then
    redis.call('DEL', slot)
  elseif decision == 'approve' then
    redis.call('HSET', slot, 'state', 'approved')
  else
    redis.call('HSET', slot, 'state', 'failed', 'error', ARGV[6], 'finished_ms', ARGV[5])
  end
end
redis.call('SREM', KEYS[5], ARGV[1])
local t = redis.call('HMGET', turn, 'status', 'attempt')
local attempt = tonumber(t[2] or '0')
local data = {attempt = attempt, approval_id = ARGV[1], decision = decision, by = by}
if reason ~= '' then
  data['reason'] = reason
else
  data['reason'] = cjson.null
end
if t[1] then
  redis.call('XADD', events, '*', 'e', 'approval_decision', 'd', cjson.encode(data))
  if redis.call('EXISTS', KEYS[6]) == 1 then
    redis.call('HINCRBY', KEYS[6], 'base', 1)
  end
end
local resumed = '0'
if t[1] == 'awaiting_approval' and by ~= 'stop' and redis.call('SCARD', KEYS[5]) == 0 then
  redis.call('HSET', turn, 'status', 'queued', 'enqueued', 0)
  resumed = '1'
end
return {'decided', decision, reason, by, resumed, tostring(attempt)}
