-- renew_viewer: keep holding the one connection a one-viewer attach token admits.
--
-- KEYS[1]  viewer         {c:<conversation>}:viewer:<token id>
-- ARGV[1]  holder         the connection's random id, set by SET NX PX when it was admitted
-- ARGV[2]  ttl_ms         the new time to live
--
-- Returns  1 when the holder still holds the key (its TTL is reset), 0 when it lost it
-- Errors   none of its own.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
