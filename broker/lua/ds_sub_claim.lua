-- ds_sub_claim: start a wake of a Durable Streams subscription under a lease with a fencing
-- token (a webhook delivery, or a pull-wake worker's claim), or record that its wake stream was
-- told (pull-wake), or find it has nothing to do.
--
-- The caller read the subscription's streams' tails and its acks just before (``pending``
-- says whether a stream has appends past its ack; ``snapshot`` lists them) after reading its
-- marks count (``marks``): when no append was marked since, a subscription with nothing
-- pending leaves the due set; otherwise it stays, and is looked at again.
--
-- A wake's generation counts its wakes: each claim (and each reclaim once a lease expired)
-- takes the next, and a callback, ack or release of another generation is fenced.
--
-- KEYS[1]  subscription  <space>:sub:<digest>  (hash: gen, wake, token, holder, until, snap,
--                                                announced)
-- KEYS[2]  due           <space>:subs:due
-- KEYS[3]  marks         <space>:subs:marks
-- ARGV[1]  id            the subscription's id
-- ARGV[2]  now_ms        the clock (ms); "" for the server's
-- ARGV[3]  mode          "deliver" (a webhook send), "claim" (a pull-wake worker) or
--                        "announce" (a pull-wake subscription's wake stream was told)
-- ARGV[4]  holder        who holds the lease ("webhook" or the worker's name)
-- ARGV[5]  token         the new fencing token
-- ARGV[6]  wake id       the new wake's id
-- ARGV[7]  ttl_ms        the lease's length
-- ARGV[8]  marks         the marks count read before the tails
-- ARGV[9]  pending       "1" when a stream has appends past its ack
-- ARGV[10] snapshot      JSON: [[path, tail offset], ...] of the wake
--
-- Returns  {"claimed", generation}   a wake started: the lease is the holder's until now+ttl
--          {"busy", holder, until}   a live lease is held (the due set looks at its end)
--          {"idle"}                  nothing pending
--          {"announced"}             (announce) recorded; (claim, deliver) never
--          {"missing"}               no such subscription
-- Errors   none of its own.
local sub, due, marks, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
if redis.call('EXISTS', sub) == 0 then
  redis.call('ZREM', due, id)
  return {'missing'}
end
local v = redis.call('HMGET', sub, 'holder', 'until')
if v[1] and v[1] ~= '' and tonumber(v[2]) > now then
  redis.call('ZADD', due, v[2], id)
  return {'busy', v[1], v[2]}
end
local function settle()
  if (redis.call('HGET', marks, id) or '0') == ARGV[8] then redis.call('ZREM', due, id) end
end
if ARGV[9] ~= '1' then
  settle()
  return {'idle'}
end
if ARGV[3] == 'announce' then
  redis.call('HSET', sub, 'announced', '1')
  settle()
  return {'announced'}
end
local gen = redis.call('HINCRBY', sub, 'gen', 1)
local expires = now + tonumber(ARGV[7])
redis.call('HSET', sub, 'wake', ARGV[6], 'token', ARGV[5], 'holder', ARGV[4],
  'until', int(expires), 'snap', ARGV[10], 'announced', '0')
-- Looked at again when the lease ends: a wake whose holder went silent is taken again.
redis.call('ZADD', due, int(expires), id)
return {'claimed', gen}
