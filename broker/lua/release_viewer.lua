-- release_viewer: free a one-viewer attach token when its connection ends, if it still holds it.
--
-- KEYS[1]  viewer         {c:<conversation>}:viewer:<token id>
-- ARGV[1]  holder         the connection's random id
--
-- Returns  1 when the key was the holder's and is deleted, 0 otherwise
-- Errors   none of its own.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
