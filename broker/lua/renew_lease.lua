-- renew_lease: extend a lease, only for the holder of its current fencing token.
--
-- KEYS[1]  lease hash  {c:<conversation>}:lease:<turn_id>
-- ARGV[1]  token       the fencing token returned by claim_lease
-- ARGV[2]  ttl_ms      new lifetime in milliseconds, from now on the server clock
--
-- Returns  1
-- Errors   "FENCED ..." when the lease expired or belongs to another token.
local lease = KEYS[1]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost or taken over')
end
redis.call('PEXPIRE', lease, ARGV[2])
return 1
