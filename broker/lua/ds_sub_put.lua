-- ds_sub_put: create a Durable Streams subscription, or confirm the same one (idempotent PUT).
--
-- A subscription is a hash of its own and its line in the tenant's registry, which the
-- append's mark (ds_sub_mark) walks; its explicit streams are linked at once.
--
-- KEYS[1]  subscription  <space>:sub:<digest>       (hash: cfg, base, gen, wake state)
-- KEYS[2]  registry      <space>:subs               (hash: id -> matcher, see ds_sub_mark)
-- KEYS[3]  links         <space>:subs:links         (hash: "<id>\n<path>" -> link type)
--          (<space> is the tenant's {ds:t:<tenant>}, or {ds:open}: one slot for all)
-- ARGV[1]  id            the subscription's id
-- ARGV[2]  cfg           its configuration, canonical JSON (compared on a second PUT)
-- ARGV[3]  matcher       "<Lua pattern>\n<wake stream>" ("" parts for none)
-- ARGV[4]  base          the URL its callbacks and JWKS are under
-- ARGV[5]  max           the most subscriptions a tenant holds (each append walks them all)
-- ARGV[6..] paths        its explicit streams
--
-- Returns  {"created"}    made
--          {"same"}       it exists with this configuration
--          {"conflict"}   it exists with another configuration
--          {"full"}       the tenant holds ARGV[5] subscriptions already
-- Errors   none of its own.
local sub, registry, links, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local cfg = redis.call('HGET', sub, 'cfg')
if cfg then
  if cfg == ARGV[2] then return {'same'} end
  return {'conflict'}
end
if redis.call('HLEN', registry) >= tonumber(ARGV[5]) then return {'full'} end
redis.call('HSET', sub, 'cfg', ARGV[2], 'base', ARGV[4], 'gen', 0)
redis.call('HSET', registry, id, ARGV[3])
for i = 6, #ARGV do
  redis.call('HSET', links, id .. '\n' .. ARGV[i], 'explicit')
end
return {'created'}
