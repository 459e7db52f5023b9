-- take_webhook: take one completion notification for a send, unless a send is in flight or
-- its backoff runs: the hold key makes every other worker wait until it expires.
--
-- The first take stores the notification's body, URL and end time; every later take (a
-- retry, by this worker or another) sends what was stored, so every try sends the same bytes.
--
-- KEYS[1]  delivery hash   <prefix>:{webhooks:<i>}:try:<job id>   (tries, body, url, ended_ms)
-- KEYS[2]  hold            <prefix>:{webhooks:<i>}:hold:<job id>
-- KEYS[3]  sent marker     <prefix>:{webhooks:<i>}:sent:<conversation> <turn> <attempt>
-- ARGV[1]  body            the notification's JSON, kept only by the first take
-- ARGV[2]  url             where to send it, kept only by the first take
-- ARGV[3]  ended_ms        when the attempt ended (ms), kept only by the first take
-- ARGV[4]  hold_ms         how long this send may take before another worker may try again
-- ARGV[5]  ttl_ms          retention of the delivery hash (it outlives every retry)
--
-- Returns  {"sent"}                             the attempt's notification was delivered
--                                                (this is a second job of it: settle it)
--          {"take", tries, body, url, ended_ms}   tries: the failed sends before this one
--          {"wait", ms}                           held for another ms (a send or a backoff)
-- Errors   none of its own.
local delivery, hold = KEYS[1], KEYS[2]
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {'sent'}
end
local left = redis.call('PTTL', hold)
if left > 0 then
  return {'wait', left}
end
if redis.call('HEXISTS', delivery, 'body') == 0 then
  redis.call('HSET', delivery, 'tries', 0, 'body', ARGV[1], 'url', ARGV[2], 'ended_ms', ARGV[3])
end
redis.call('SET', hold, '1', 'PX', ARGV[4])
redis.call('PEXPIRE', delivery, ARGV[5])
local v = redis.call('HMGET', delivery, 'tries', 'body', 'url', 'ended_ms')
return {'take', v[1] or '0', v[2], v[3], v[4] or '0'}
