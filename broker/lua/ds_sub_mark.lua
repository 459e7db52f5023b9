-- ds_sub_mark: an append (or a creation) reached a stream: link it to the tenant's
-- subscriptions whose pattern matches its path, and mark every subscription it is linked to as
-- due, so that a wake goes out. A tenant without subscriptions costs one EXISTS.
--
-- KEYS[1]  registry      <space>:subs        (hash: id -> "<Lua pattern>\n<wake stream>")
-- KEYS[2]  links         <space>:subs:links  (hash: "<id>\n<path>" -> "pattern" or "explicit")
-- KEYS[3]  due           <space>:subs:due    (sorted set: id -> when to look, ms)
-- KEYS[4]  marks         <space>:subs:marks  (hash: id -> appends marked so far)
-- ARGV[1]  path          the stream's path
-- ARGV[2]  now_ms        the clock (ms)
--
-- Returns  the number of subscriptions marked
-- Errors   none of its own.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local path, now = ARGV[1], ARGV[2]
local all = redis.call('HGETALL', KEYS[1])
local marked = 0
for i = 1, #all, 2 do
  local id, matcher = all[i], all[i + 1]
  local cut = string.find(matcher, '\n', 1, true)
  local pattern, wake = string.sub(matcher, 1, cut - 1), string.sub(matcher, cut + 1)
  -- A pull-wake subscription's own wake stream never wakes it.
  if path ~= wake then
    local field = id .. '\n' .. path
    local linked = redis.call('HEXISTS', KEYS[2], field) == 1
    if not linked and pattern ~= '' and string.find(path, pattern) then
      redis.call('HSET', KEYS[2], field, 'pattern')
      linked = true
    end
    if linked then
      redis.call('ZADD', KEYS[3], 'LT', now, id)
      redis.call('HINCRBY', KEYS[4], id, 1)
      marked = marked + 1
    end
  end
end
return marked
