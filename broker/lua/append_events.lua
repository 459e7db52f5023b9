-- append_events: append events to a turn's stream, only for the holder of the live lease.
--
-- The entry ids that XADD assigns are the events' offsets. Every event is in Redis before any
-- reader can see it: readers only ever read the stream.
--
-- KEYS[1]  lease hash     {c:<conversation>}:lease:<turn_id>
-- KEYS[2]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[3]  turn hash      {c:<conversation>}:turn:<turn_id>
-- ARGV[1]  token          the fencing token returned by claim_lease
-- ARGV[2]  max_events     the stream may hold at most this many entries after the append
-- ARGV[3], ARGV[4], ...   pairs of (event type, JSON data), in order
--
-- Returns  the list of assigned entry ids, one per event
-- Errors   "FENCED ..."       the lease expired or belongs to another token; nothing appended
--          "CANCELLED ..."    the user asked to stop this attempt; nothing appended
--          "STREAM_FULL ..."  the append would pass max_events; nothing appended
local lease, events = KEYS[1], KEYS[2]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost or taken over')
end
if redis.call('HEXISTS', KEYS[3], 'cancel') == 1 then
  return redis.error_reply('CANCELLED a stop was requested')
end
local n = (#ARGV - 2) / 2
if redis.call('XLEN', events) + n > tonumber(ARGV[2]) then
  return redis.error_reply('STREAM_FULL the stream reached its maximum number of events')
end
local ids = {}
for i = 3, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', events, '*', 'e', ARGV[i], 'd', ARGV[i + 1])
end
return ids
