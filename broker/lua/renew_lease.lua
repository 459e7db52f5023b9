-- renew_lease: extend a lease, only for the holder of its current fencing token, and tell the
-- holder whether the user asked to stop (the fallback when a stop notification was missed).
--
-- KEYS[1]  lease hash  {c:<conversation>}:lease:<turn_id>
-- KEYS[2]  turn hash   {c:<conversation>}:turn:<turn_id>
-- ARGV[1]  token       the fencing token returned by claim_lease
-- ARGV[2]  ttl_ms      new lifetime in milliseconds, from now on the server clock
--
-- Returns  1, or 2 when a stop was requested
-- Errors   "FENCED ..." when the lease expired or belongs to another token.
local lease = KEYS[1]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost or taken over')
end
redis.call('PEXPIRE', lease, ARGV[2])
if redis.call('HEXISTS', KEYS[2], 'cancel') == 1 then
  return 2
end
return 1
