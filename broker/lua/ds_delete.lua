-- ds_delete: delete a Durable Streams stream and all it holds.
--
-- Its live readers find out at their next look (a long poll's end, an SSE heartbeat).
--
-- KEYS[1]  metadata      <prefix>:{ds:<digest>}:meta
-- KEYS[2]  data          <prefix>:{ds:<digest>}:data
-- KEYS[3]  producers     <prefix>:{ds:<digest>}:producers
--
-- Returns  1 deleted, 0 no such stream
-- Errors   none of its own.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
