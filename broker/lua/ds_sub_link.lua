-- ds_sub_link: add explicit streams to a Durable Streams subscription, or remove streams from
-- it (explicit or matched by its pattern). An added stream is looked at soon (it may hold
-- appends no one acked).
--
-- KEYS[1]  subscription  <space>:sub:<digest>
-- KEYS[2]  links         <space>:subs:links
-- KEYS[3]  due           <space>:subs:due
-- KEYS[4]  acked         <space>:sub:<digest>:acked
-- ARGV[1]  id            the subscription's id
-- ARGV[2]  op            "add" or "remove"
-- ARGV[3]  now_ms        the clock (ms)
-- ARGV[4..] paths        the streams
--
-- Returns  1 done, 0 no such subscription
-- Errors   none of its own.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local id = ARGV[1]
for i = 4, #ARGV do
  local field = id .. '\n' .. ARGV[i]
  if ARGV[2] == 'add' then
    redis.call('HSET', KEYS[2], field, 'explicit')
  else
    redis.call('HDEL', KEYS[2], field)
    redis.call('HDEL', KEYS[4], ARGV[i])
  end
end
if ARGV[2] == 'add' then redis.call('ZADD', KEYS[3], ARGV[3], id) end
return 1
