-- request_approval: park a tool-call slot until a person decides, atomically with its claim.
--
-- A call whose tool's rule asks for approval is never dispatched at once: its slot is claimed
-- as `awaiting_approval`, and the approval request is stored beside it. A slot that already
-- holds the call answers what it holds, so a regenerate, a retry or a takeover meets the same
-- pending approval instead of asking a second time.
--
-- KEYS[1]  slot hash       {c:<conversation>}:tool:<turn_id>:<tool>:<ordinal>
-- KEYS[2]  turn's slots    {c:<conversation>}:tools:<turn_id> (a set, for the audit)
-- KEYS[3]  turn lease      {c:<conversation>}:lease:<turn_id>
-- KEYS[4]  approval hash   {c:<conversation>}:approval:<turn_id>:<approval_id> (ARGV[6]'s)
-- ARGV[1]  fingerprint     hex SHA-256 of the canonical JSON of the arguments
-- ARGV[2]  owner           who claims (for operators)
-- ARGV[3]  retention_ms    how long the slot and the approval are kept
-- ARGV[4]  row             JSON of the slot's description (tool, ordinal, attempt, args, class)
-- ARGV[5]  lease token     the caller's turn lease token ("" to skip the check)
-- ARGV[6]  approval_id     the id of a new request (used only if none is pending)
-- ARGV[7]  expires_ms      when a new request expires (ms since the epoch, the approvals' clock)
-- ARGV[8]  request         JSON stored with a new request (tool, args, call_id, ordinal, attempt)
-- ARGV[9]  now_ms          the approvals' clock now
--
-- Returns  {"requested", approval_id, expires_ms}  a new request: the call waits for a person
--          {"pending", approval_id, expires_ms}    the slot already waits: the same request
--          {"decided", state}          the slot is past waiting (approved, completed, failed,
--                                      in_flight): the caller claims it with claim_tool
--          {"args_mismatch", fp}       the slot holds a call with other arguments
--          {"fenced"}                  the caller's turn lease is not current: nothing changed
-- The slot hash gains approval_id and approval_expires_ms; the approval hash holds slot,
-- request, expires_ms, requested_ms (and, once decided, decision, reason, by, decided_ms).
-- Errors   none of its own.
local slot = KEYS[1]
if ARGV[5] ~= '' and redis.call('HGET', KEYS[3], 'token') ~= ARGV[5] then
  return {'fenced'}
end
local v = redis.call('HMGET', slot, 'state', 'fingerprint', 'approval_id', 'approval_expires_ms')
local state = v[1]
if not state then
  local now_ms = tonumber(ARGV[9])
  redis.call('HSET', slot, 'state', 'awaiting_approval', 'fingerprint', ARGV[1], 'token', 0,
    'lease_until', 0, 'owner', ARGV[2], 'claimed_ms', now_ms, 'row', ARGV[4], 'reclaims', 0,
    'approval_id', ARGV[6], 'approval_expires_ms', ARGV[7])
  redis.call('HSET', KEYS[4], 'slot', slot, 'request', ARGV[8], 'expires_ms', ARGV[7],
    'requested_ms', now_ms)
  redis.call('SADD', KEYS[2], slot)
  for i = 1, 4 do
    if i ~= 3 then
      redis.call('PEXPIRE', KEYS[i], ARGV[3])
    end
  end
  return {'requested', ARGV[6], ARGV[7]}
end
redis.call('PEXPIRE', slot, ARGV[3])
if v[2] ~= ARGV[1] then
  return {'args_mismatch', v[2]}
end
if state == 'awaiting_approval' then
  return {'pending', v[3], v[4]}
end
return {'decided', state}
