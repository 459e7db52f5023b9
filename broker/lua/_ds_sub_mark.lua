-- _ds_sub_mark: the mark of Durable Streams subscriptions that ds_append and ds_create make
-- after a write to a stream, and ds_sub_mark on its own. broker/scripts.py puts this text in
-- place of a script's "--! include _ds_sub_mark" line. Functions only: it reads no KEYS or ARGV.
--
-- sub_mark(registry, links, due, marks, path, now_ms)
--     links the tenant's subscriptions whose pattern matches ``path`` to it, and marks every
--     subscription linked to it as due at ``now_ms`` (sooner only) with one more mark; returns
--     how many it marked. A subscription's own wake stream never marks it. A tenant without
--     subscriptions costs one EXISTS.
--       registry  <space>:subs        (hash: id -> "<Lua pattern>\n<wake stream>")
--       links     <space>:subs:links  (hash: "<id>\n<path>" -> "pattern" or "explicit")
--       due       <space>:subs:due    (sorted set: id -> when to look, ms)
--       marks     <space>:subs:marks  (hash: id -> appends marked so far)
local function sub_mark(registry, links, due, marks, path, now_ms)
  if redis.call('EXISTS', registry) == 0 then return 0 end
  local now = string.format('%d', now_ms)
  local all = redis.call('HGETALL', registry)
  local marked = 0
  for i = 1, #all, 2 do
    local id, matcher = all[i], all[i + 1]
    local cut = string.find(matcher, '\n', 1, true)
    local pattern, wake = string.sub(matcher, 1, cut - 1), string.sub(matcher, cut + 1)
    if path ~= wake then
      local field = id .. '\n' .. path
      local linked = redis.call('HEXISTS', links, field) == 1
      if not linked and pattern ~= '' and string.find(path, pattern) then
        redis.call('HSET', links, field, 'pattern')
        linked = true
      end
      if linked then
        redis.call('ZADD', due, 'LT', now, id)
        redis.call('HINCRBY', marks, id, 1)
        marked = marked + 1
      end
    end
  end
  return marked
end
