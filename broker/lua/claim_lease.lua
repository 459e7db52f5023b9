-- claim_lease: take the writer lease of a turn's attempt, minting a new fencing token.
--
-- The lease expires on the Redis server clock (PEXPIRE), so no worker clock is trusted. Each claim
-- increments the turn's fence counter; appends must present the token of the live lease.
--
-- KEYS[1]  turn hash   {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  lease hash  {c:<conversation>}:lease:<turn_id>
-- KEYS[3]  event stream {c:<conversation>}:events:<turn_id> (its length is the lease's `base`)
-- ARGV[1]  owner       the worker's id (for operators; not used for fencing)
-- ARGV[2]  ttl_ms      lease lifetime in milliseconds
-- ARGV[3]  attempt     the attempt number the job was queued for
--
-- Returns  {"claimed", token, previous_status, cancel}  previous_status "streaming" means a
--                                  takeover; cancel is "1" when a stop was requested meanwhile
--          {"held", owner, pttl_ms}             another owner's live lease exists; nothing
--                                               changed. The same owner claims anew: it sends
--                                               a claim again when the reply of its first was
--                                               lost, and claims a turn from one task at a time.
--          {"stale", status, attempt}           the turn is at rest or moved to another attempt
--          {"missing"}                          the turn does not exist (expired)
-- The lease hash holds: token, owner, base (the stream's length at the claim: append_events
-- counts on from it), cancel (set when a stop was requested) and appended (append_events').
-- Errors   none of its own.
local turn, lease = KEYS[1], KEYS[2]
if redis.call('EXISTS', turn) == 0 then
  return {'missing'}
end
local v = redis.call('HMGET', turn, 'status', 'attempt', 'cancel')
local status, attempt = v[1], v[2]
if attempt ~= ARGV[3] or (status ~= 'queued' and status ~= 'streaming') then
  return {'stale', status or '', attempt or ''}
end
local holder = redis.call('HGET', lease, 'owner')
if holder and holder ~= ARGV[1] then
  return {'held', holder, redis.call('PTTL', lease)}
end
local token = redis.call('HINCRBY', turn, 'fence', 1)
redis.call('DEL', lease)
redis.call('HSET', lease, 'token', token, 'owner', ARGV[1], 'base', redis.call('XLEN', KEYS[3]))
if v[3] then
  redis.call('HSET', lease, 'cancel', v[3])  -- a stop requested before this claim (a takeover)
end
redis.call('PEXPIRE', lease, ARGV[2])
redis.call('HSET', turn, 'status', 'streaming')
return {'claimed', tostring(token), status, v[3] and '1' or '0'}
