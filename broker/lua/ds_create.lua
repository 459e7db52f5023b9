-- ds_create: create a Durable Streams stream, or find the same one (idempotent PUT).
--
-- A stream that exists is "the same" when its content type, TTL, expiry and closure all match
-- the request; its data is never touched then. A new stream keeps its configuration in its
-- metadata hash, its initial body (if any) as its first entry, and, with a TTL or an expiry,
-- the same expiry on all its keys.
--
-- KEYS[1]  metadata      <prefix>:{ds:<digest>}:meta       (hash; its existence is the stream's)
-- KEYS[2]  data          <prefix>:{ds:<digest>}:data       (Redis Stream of appends)
-- KEYS[3]  producers     <prefix>:{ds:<digest>}:producers  (hash: producer id -> "epoch seq")
-- KEYS[4]  forks         <prefix>:{ds:<digest>}:forks      (set: its forks' scoped paths)
-- ARGV[1]  path          the stream's scoped path, kept for the record
-- ARGV[2]  content type  normalized (lower case, no parameters)
-- ARGV[3]  ttl_s         sliding time to live in seconds, or "" for none
-- ARGV[4]  expires_ms    absolute expiry (Unix ms), or "" for none
-- ARGV[5]  expires_at    the expiry as the client wrote it (echoed on HEAD), or ""
-- ARGV[6]  closed        "1" to create the stream closed, else ""
-- ARGV[7]  body          the initial entry's payload, or "" for none
-- ARGV[8]  incarnation   a random id of this stream's life (a re-created stream differs)
-- ARGV[9]  raw type      the content type as the client wrote it (echoed on reads)
-- ARGV[10] source        a fork's source (its scoped path), or "" for a stream of its own
-- ARGV[11] fork offset   the fork's divergence point as the client gave it (an entry id), or
--                        "" (the source's tail, resolved by the caller: ARGV[12])
-- ARGV[12] resolved      the divergence point the fork was made at (an entry id), or ""
-- ARGV[13] sub-offset    a fork's sub-offset ("" for none or 0)
-- ARGV[14..]             a fork's inherited entries, copied: entry id, payload, entry id, ...
--                        (ids in order, each past the last), before its initial body
--
-- Returns  {"created", tail, closed, type}   tail: the last entry id ("0-0": none); closed "1"
--                                            or ""; type: the content type as the stream keeps
--                                            it (as its creator wrote it)
--          {"exists", tail, closed, type}    the same stream was there already
--          {"conflict", what}          a stream is there with another configuration
--                                      (what: content_type, ttl, expiry, closed or fork), or a
--                                      deleted stream's forks still hold its path (deleted)
-- Errors   none of its own.
local meta, data, producers = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', meta) == 1 then
  local v = redis.call('HMGET', meta, 'ct', 'ttl', 'exp', 'closed', 'tail', 'deleted', 'ff',
    'fo', 'fs', 'ctr')
  if v[6] == '1' then return {'conflict', 'deleted'} end
  if (v[7] or '') ~= ARGV[10] or (v[9] or '') ~= ARGV[13] then return {'conflict', 'fork'} end
  if ARGV[11] ~= '' and (v[8] or '') ~= ARGV[11] then return {'conflict', 'fork'} end
  if v[1] ~= ARGV[2] then return {'conflict', 'content_type'} end
  if (v[2] or '') ~= ARGV[3] then return {'conflict', 'ttl'} end
  if (v[3] or '') ~= ARGV[4] then return {'conflict', 'expiry'} end
  if (v[4] or '') ~= ARGV[6] then return {'conflict', 'closed'} end
  return {'exists', v[5] or '0-0', v[4] or '', v[10] or ''}
end
-- A stream deleted and made again starts empty: nothing of the old one is kept.
redis.call('DEL', data, producers, KEYS[4])
local tail = '0-0'
for i = 14, #ARGV, 2 do
  tail = redis.call('XADD', data, ARGV[i], 'e', 'm', 'd', ARGV[i + 1])
end
if ARGV[7] ~= '' then
  tail = redis.call('XADD', data, '*', 'e', 'm', 'd', ARGV[7])
end
redis.call('HSET', meta, 'path', ARGV[1], 'ct', ARGV[2], 'ctr', ARGV[9], 'tail', tail,
  'inc', ARGV[8])
if ARGV[10] ~= '' then
  redis.call('HSET', meta, 'ff', ARGV[10], 'fo', ARGV[12], 'fs', ARGV[13])
end
if ARGV[3] ~= '' then redis.call('HSET', meta, 'ttl', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', meta, 'exp', ARGV[4], 'exp_text', ARGV[5]) end
if ARGV[6] == '1' then
  redis.call('HSET', meta, 'closed', '1')
  redis.call('XADD', data, '*', 'e', 'close', 'd', '')
end
for _, key in ipairs({meta, data}) do
  if ARGV[3] ~= '' then
    redis.call('PEXPIRE', key, tonumber(ARGV[3]) * 1000)
  elseif ARGV[4] ~= '' then
    redis.call('PEXPIREAT', key, ARGV[4])
  end
end
return {'created', tail, ARGV[6], ARGV[9]}
