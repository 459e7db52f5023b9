-- append_events: append events to a turn's stream, only for the holder of the live lease.
--
-- The entry ids that XADD assigns are the events' offsets. Every event is in Redis before any
-- reader can see it: readers only ever read the stream.
--
-- KEYS[1]  lease hash     {c:<conversation>}:lease:<turn_id>
-- KEYS[2]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[3]  turn hash      {c:<conversation>}:turn:<turn_id> (read only for a lease claimed
--                           by a version that did not record `base`)
-- ARGV[1]  token          the fencing token returned by claim_lease
-- ARGV[2]  max_events     the stream may hold at most this many entries after the append
-- ARGV[3]  appended       how many events this token appended before this batch
-- ARGV[4], ARGV[5], ...   pairs of (event type, JSON data), in order
--
-- The lease hash counts the events appended under its token (field `appended`), which makes an
-- append safe to send again when its reply was lost (a connection cut, a Redis restart): a batch
-- already appended is answered with its ids, and appended nothing twice. While a lease holds,
-- nothing but its own appends is added to the stream (a stop only flags the lease, and the end
-- is written by finish_attempt, which drops it), so `base` (the length at the claim) plus
-- `appended` is the stream's length: no XLEN per append. A stop (cancel_turn) is flagged on the
-- lease as well as the turn, so one HMGET of the lease holds every check: a single-event append
-- is four calls (the HMGET, the XADD, the HINCRBY, and the call of the script itself).
--
-- Returns  the list of assigned entry ids, one per event
-- Errors   "FENCED ..."       the lease expired or belongs to another token, or `appended` is
--                             not this token's count; nothing appended
--          "CANCELLED ..."    the user asked to stop this attempt; nothing appended
--          "STREAM_FULL ..."  the append would pass max_events; nothing appended
local lease, events = KEYS[1], KEYS[2]
-- One read of the lease answers every check: its token, its count, the stream's length when it
-- was claimed, and a stop requested since (see claim_lease and cancel_turn).
local v = redis.call('HMGET', lease, 'token', 'appended', 'base', 'cancel')
if v[1] ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost or taken over')
end
local n = (#ARGV - 3) / 2
local before = tonumber(ARGV[3])
local appended = tonumber(v[2] or '0')
if n > 0 and appended == before + n then
  -- This batch was appended, and its reply lost: it is the stream's tail.
  local tail = redis.call('XREVRANGE', events, '+', '-', 'COUNT', n)
  local ids = {}
  for i = #tail, 1, -1 do
    ids[#ids + 1] = tail[i][1]
  end
  return ids
end
if appended ~= before then
  return redis.error_reply('FENCED appends out of order for this token')
end
local length
if v[3] then
  length = tonumber(v[3]) + appended
else
  -- A lease claimed before leases recorded their base: read the turn as it was read then.
  if redis.call('HEXISTS', KEYS[3], 'cancel') == 1 then
    return redis.error_reply('CANCELLED a stop was requested')
  end
  length = redis.call('XLEN', events)
end
if v[4] then
  return redis.error_reply('CANCELLED a stop was requested')
end
if length + n > tonumber(ARGV[2]) then
  return redis.error_reply('STREAM_FULL the stream reached its maximum number of events')
end
local ids = {}
for i = 4, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', events, '*', 'e', ARGV[i], 'd', ARGV[i + 1])
end
redis.call('HINCRBY', lease, 'appended', n)
return ids
