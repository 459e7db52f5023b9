-- claim_tool: claim a tool-call slot before acting, so a repeated call never runs twice.
--
-- A slot is (conversation, turn, tool, ordinal of that tool's calls in the attempt). Its
-- lease runs on the Redis server clock; each claim or reclaim mints a new fencing token, and
-- only the current token may finish the call.
--
-- KEYS[1]  slot hash        {c:<conversation>}:tool:<turn_id>:<tool>:<ordinal>
-- KEYS[2]  turn's slots     {c:<conversation>}:tools:<turn_id> (a set, for the audit)
-- KEYS[3]  turn lease       {c:<conversation>}:lease:<turn_id>
-- ARGV[1]  fingerprint      hex SHA-256 of the canonical JSON of the arguments
-- ARGV[2]  lease_ms         the claim's lease
-- ARGV[3]  owner            who claims (for operators)
-- ARGV[4]  retention_ms     how long the slot is kept
-- ARGV[5]  row              JSON of the slot's description (tool, ordinal, attempt, args, class)
-- ARGV[6]  lease token      the caller's turn lease token ("" to skip the check): a worker
--                           that lost the turn may not start its tool calls
--
-- Returns  {"claimed", token}          first claim: the caller runs the call
--          {"completed", result}       it ran: the stored result (JSON)
--          {"failed", error}           it failed: the stored error (JSON), replayed as is
--          {"in_flight", pttl_ms}      another holder runs it now
--          {"args_mismatch", fp}       the slot holds a call with other arguments
--          {"reclaimed", token, n}     the holder's lease expired: the caller holds it now
--                                      (n = how many times it was reclaimed)
--          {"awaiting_approval"}       the slot waits for a person (request_approval.lua):
--                                      nothing runs until it is decided
--          {"fenced"}                  the caller's turn lease is not current: nothing changed
-- A slot a person approved (state "approved") is claimed as a new one is: it runs once.
-- Every answer but "fenced" restarts the slot's retention, so a slot outlives its turn.
-- Errors   none of its own.
local slot = KEYS[1]
if ARGV[6] ~= '' and redis.call('HGET', KEYS[3], 'token') ~= ARGV[6] then
  return {'fenced'}
end
redis.call('PEXPIRE', slot, ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local v = redis.call('HMGET', slot, 'state', 'fingerprint', 'lease_until', 'result', 'error')
local state = v[1]
if not state or (state == 'approved' and v[2] == ARGV[1]) then
  local token = redis.call('HINCRBY', slot, 'token', 1)
  redis.call('HSET', slot, 'state', 'in_flight', 'fingerprint', ARGV[1],
    'lease_until', now_ms + tonumber(ARGV[2]), 'owner', ARGV[3], 'claimed_ms', now_ms,
    'row', ARGV[5], 'reclaims', 0)
  redis.call('PEXPIRE', slot, ARGV[4])
  redis.call('SADD', KEYS[2], slot)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return {'claimed', tostring(token)}
end
if v[2] ~= ARGV[1] then
  return {'args_mismatch', v[2]}
end
if state == 'awaiting_approval' then
  return {'awaiting_approval'}
end
if state == 'completed' then
  return {'completed', v[4]}
end
if state == 'failed' then
  return {'failed', v[5]}
end
local remaining = tonumber(v[3]) - now_ms
if remaining > 0 then
  return {'in_flight', remaining}
end
local token = redis.call('HINCRBY', slot, 'token', 1)
local reclaims = redis.call('HINCRBY', slot, 'reclaims', 1)
redis.call('HSET', slot, 'lease_until', now_ms + tonumber(ARGV[2]), 'owner', ARGV[3])
return {'reclaimed', tostring(token), reclaims}
