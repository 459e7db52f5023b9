-- renew_tool: extend the lease of a claimed tool call, only for its current token.
--
-- KEYS[1]  slot hash   {c:<conversation>}:tool:<turn_id>:<tool>:<ordinal>
-- ARGV[1]  token       the token from claim_tool
-- ARGV[2]  lease_ms    the new lease, from now on the server clock (0: release it now, so the
--                       next claim reclaims the slot)
--
-- Returns  1
-- Errors   "FENCED ..." when the token is not current or the call is no longer in flight.
local slot = KEYS[1]
local v = redis.call('HMGET', slot, 'token', 'state')
if v[1] ~= ARGV[1] or v[2] ~= 'in_flight' then
  return redis.error_reply('FENCED tool claim lost or taken over')
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', slot, 'lease_until', now_ms + tonumber(ARGV[2]))
return 1
