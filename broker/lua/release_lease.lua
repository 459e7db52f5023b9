-- release_lease: give up a lease at once, only for the holder of its current fencing token.
--
-- A worker shutting down hands back an attempt that delivered nothing yet: with the lease gone,
-- the next worker claims the turn without waiting for the lease to expire, and its claim mints a
-- new token (the fence counter lives in the turn hash, so no token is ever handed out twice).
--
-- KEYS[1]  lease hash  {c:<conversation>}:lease:<turn_id>
-- ARGV[1]  token       the fencing token returned by claim_lease
--
-- Returns  1 when the lease was released, 0 when it was not this token's (expired, taken over)
-- Errors   none of its own.
local lease = KEYS[1]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', lease)
return 1
