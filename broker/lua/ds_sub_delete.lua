-- ds_sub_delete: delete a Durable Streams subscription, its links, acks and wake state.
--
-- KEYS[1]  subscription  <space>:sub:<digest>
-- KEYS[2]  acked         <space>:sub:<digest>:acked  (hash: path -> acked offset)
-- KEYS[3]  registry      <space>:subs
-- KEYS[4]  links         <space>:subs:links
-- KEYS[5]  due           <space>:subs:due           (sorted set: id -> when to look, ms)
-- KEYS[6]  marks         <space>:subs:marks         (hash: id -> appends marked so far)
-- ARGV[1]  id            the subscription's id
--
-- Returns  1 deleted, 0 there was none
-- Errors   none of its own.
local id = ARGV[1]
local found = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('HDEL', KEYS[3], id)
redis.call('ZREM', KEYS[5], id)
redis.call('HDEL', KEYS[6], id)
local prefix = id .. '\n'
for _, field in ipairs(redis.call('HKEYS', KEYS[4])) do
  if string.sub(field, 1, #prefix) == prefix then redis.call('HDEL', KEYS[4], field) end
end
return found
