-- ds_sub_ack: a wake's holder acks offsets of its streams, and keeps the wake (its lease
-- starts again) or ends it (done, or a release: no acks). Fenced unless the wake id, the
-- generation and the token are the live wake's and its lease has not ended.
--
-- KEYS[1]  subscription  <space>:sub:<digest>
-- KEYS[2]  acked         <space>:sub:<digest>:acked  (hash: path -> acked offset)
-- KEYS[3]  due           <space>:subs:due
-- KEYS[4]  links         <space>:subs:links  (hash: "<id>\n<path>" -> link type)
-- ARGV[1]  id            the subscription's id
-- ARGV[2]  now_ms        the clock (ms); "" for the server's
-- ARGV[3]  token         the wake's fencing token
-- ARGV[4]  wake id
-- ARGV[5]  generation
-- ARGV[6]  done          "1" ends the wake
-- ARGV[7]  ttl_ms        the lease's length (renewed when the wake goes on)
-- ARGV[8]  retry         "" for an ack, a callback or a release; for a webhook send that
--                        failed, "<first_ms> <max_ms> <fraction>": the wake ends and the
--                        subscription is looked at again after min(max, first * 2^(failures
--                        - 1)) * fraction ms (the caller draws the fraction: jitter)
-- ARGV[9]  acks          JSON: [[path, offset], ...]; an offset before the path's ack is kept
--
-- Returns  {"ok", next_wake, pause}  next_wake: 1 when a stream of the wake's snapshot still
--                              has appends past its ack (another wake follows); pause: (retry)
--                              the ms until the next send, else 0
--          {"unknown_stream", path}  an ack names a stream that is not the subscription's
--          {"fenced"}          not the live wake (or its lease ended)
--          {"missing"}         no such subscription
-- Errors   none of its own.
local sub, acked, due, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
-- Whether a sorts before b, byte by byte (Lua's own comparison follows the locale).
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
if redis.call('EXISTS', sub) == 0 then return {'missing'} end
local v = redis.call('HMGET', sub, 'wake', 'gen', 'token', 'until', 'snap')
if not v[1] or v[1] ~= ARGV[4] or v[2] ~= ARGV[5] or v[3] ~= ARGV[3]
    or tonumber(v[4] or '0') <= now then
  return {'fenced'}
end
local acks = cjson.decode(ARGV[9])
for _, ack in ipairs(acks) do
  if redis.call('HEXISTS', KEYS[4], id .. '\n' .. ack[1]) == 0 then
    return {'unknown_stream', ack[1]}
  end
end
for _, ack in ipairs(acks) do
  local held = redis.call('HGET', acked, ack[1])
  if not held or before(held, ack[2]) then redis.call('HSET', acked, ack[1], ack[2]) end
end
if ARGV[6] ~= '1' then
  redis.call('HSET', sub, 'until', int(now + tonumber(ARGV[7])))
  return {'ok', 0, 0}
end
local next_wake = 0
for _, stream in ipairs(cjson.decode(v[5] or '[]')) do
  local held = redis.call('HGET', acked, stream[1])
  if not held or before(held, stream[2]) then next_wake = 1 end
end
redis.call('HDEL', sub, 'wake', 'token', 'holder', 'until')
local pause = 0
if ARGV[8] ~= '' then
  local first, most, fraction = string.match(ARGV[8], '^(%d+) (%d+) ([%d.]+)$')
  local failures = redis.call('HINCRBY', sub, 'tries', 1)
  local ceiling = math.min(tonumber(most), tonumber(first) * 2 ^ math.min(failures - 1, 40))
  pause = math.max(1, math.floor(ceiling * tonumber(fraction)))
else
  redis.call('HDEL', sub, 'tries')
end
redis.call('ZADD', due, int(now + pause), id)
return {'ok', next_wake, pause}
