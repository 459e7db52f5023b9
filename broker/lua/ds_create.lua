-- ds_create: create a Durable Streams stream (a fork of another included), or find the same one
-- (idempotent PUT), under its tenant's quota.
--
-- A stream that exists is "the same" when its content type, TTL, expiry and closure all match
-- the request; its data is never touched then. A new stream keeps its configuration in its
-- metadata hash, its initial body (if any) as its last entry, and, with a TTL or an expiry,
-- the same expiry on all its keys. A fork copies nothing: it records its source, the fork point
-- and its chain (meta fc: each stream it reads from, nearest first, with the last entry id it
-- reads there, "<digest> <entry id> ..."; at most MAX_FORK_DEPTH), and its own data starts
-- empty after the fork point (its last id), holding the first part of the source's next append
-- (a sub-offset, cut by the caller) and its own appends. It holds a reference on its source
-- (see _ds_quota), which this pins. A fork is charged what it adds (its part and body), not what
-- it inherits: its source stays charged for that while it is pinned.
--
-- The tenant's quota: every call takes a token of the tenant's append rate; a new stream needs
-- room for one more stream and for its bytes. Streams whose expiry passed (by more than two
-- seconds, so that the keys are surely gone) give their share back first.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta       (hash; its existence is the stream's)
-- KEYS[2]  data          <space>:s:<digest>:data       (Redis Stream of appends)
-- KEYS[3]  producers     <space>:s:<digest>:producers  (hash: producer id -> "epoch seq")
-- KEYS[4]  forks         <space>:s:<digest>:forks      (set: its forks' paths)
-- KEYS[5]  source meta   a fork's source's metadata (the stream's own KEYS[1] for no fork)
-- KEYS[6]  source data   a fork's source's data (KEYS[2] for no fork)
-- KEYS[7]  source forks  a fork's source's forks set (KEYS[4] for no fork)
-- KEYS[8]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- KEYS[9]  sizes         <space>:sizes    (hash: counted stream digest -> bytes)
-- KEYS[10] usage         <space>:usage    (hash: bytes; tokens, ts: the append rate's bucket)
-- KEYS[11..14]          the tenant's subscriptions: <space>:subs, :subs:links, :subs:due,
--                        :subs:marks (see _ds_sub_mark.lua: a creation marks those it concerns)
--          (<space> is the tenant's {ds:t:<tenant>}, or {ds:open}: one slot for all)
--          and, built from KEYS[8] (see _ds_quota): the tenant's refs hash, the data of the
--          source's chain, and the keys of a fork gone meanwhile whose reference is given back
-- ARGV[1]  path          the stream's path, kept for the record
-- ARGV[2]  content type  normalized (lower case, no parameters)
-- ARGV[3]  ttl_s         sliding time to live in seconds, or "" for none
-- ARGV[4]  expires_ms    absolute expiry (Unix ms), or "" for none
-- ARGV[5]  expires_at    the expiry as the client wrote it (echoed on HEAD), or ""
-- ARGV[6]  closed        "1" to create the stream closed, else ""
-- ARGV[7]  body          the initial entry's payload, or "" for none
-- ARGV[8]  incarnation   a random id of this stream's life (a re-created stream differs)
-- ARGV[9]  raw type      the content type as the client wrote it (echoed on reads)
-- ARGV[10] source        a fork's source (its path), or "" for a stream of its own
-- ARGV[11] fork offset   the fork's divergence point as the client gave it (an entry id), or
--                        "" (the source's tail, resolved by the caller: ARGV[12])
-- ARGV[12] resolved      the divergence point the fork is made at (an entry id), or ""
-- ARGV[13] sub-offset    a fork's sub-offset ("" for none or 0)
-- ARGV[14] part          the sub-offset's part of the source's next append, or ""
-- ARGV[15] member        this stream's digest (its name in the tenant's accounting)
-- ARGV[16] source member the source's digest, or ""
-- ARGV[17] max streams   the tenant's most streams (BROKER_DS_TENANT_MAX_STREAMS); 0: no limit
-- ARGV[18] max bytes     the tenant's most bytes (BROKER_DS_TENANT_MAX_BYTES); 0: no limit
-- ARGV[19] rate          the tenant's appends per second (BROKER_DS_TENANT_APPENDS_PER_S); 0: none
-- ARGV[20] burst         the rate's bucket (BROKER_DS_TENANT_APPEND_BURST)
--
-- Returns  {"created", tail, closed, type}   tail: the last entry id ("0-0": none); closed "1"
--                                            or ""; type: the content type as the stream keeps
--                                            it (as its creator wrote it)
--          {"exists", tail, closed, type}    the same stream was there already
--          {"conflict", what}          a stream is there with another configuration
--                                      (what: content_type, ttl, expiry, closed or fork), or a
--                                      deleted or expired stream's forks still hold its path
--                                      (deleted)
--          {"rate", retry_after_ms}    the tenant appends faster than its rate: nothing done
--          {"quota", which, limit}     no room: which is "streams" or "bytes"; nothing done
--          {"source_missing"}          a fork's source does not exist
--          {"source_deleted"}          a fork's source is deleted (its forks still live)
--          {"past_tail"}               the fork point is past the source's tail
--          {"too_deep", max}           the fork would read through more than max streams
-- Errors   none of its own.
-- Uses     _ds_quota.lua (clock_ms, int, release, prune, take_token, key_of, unref,
--          MAX_FORK_DEPTH) and _ds_sub_mark.lua (sub_mark), put in place below.
--! include _ds_quota
--! include _ds_sub_mark
local meta, data, producers = KEYS[1], KEYS[2], KEYS[3]
local streams, sizes, usage = KEYS[8], KEYS[9], KEYS[10]
local member = ARGV[15]
local now_ms = clock_ms()

-- Expired streams first, then a token of the rate.
prune(streams, sizes, usage, now_ms)
local wait_ms = take_token(usage, tonumber(ARGV[19]), tonumber(ARGV[20]), now_ms)
if wait_ms then return {'rate', wait_ms} end

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

-- Whether entry id a is after entry id b.
local function after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end

-- A fork's source, its chain (each stream it reads from, nearest first, with the last entry
-- id it reads there: "<digest> <bound> ..."), and the last entry it inherits.
local fork = ARGV[10] ~= ''
local chain, inherited_tail = '', '0-0'
if fork then
  local s = redis.call('HMGET', KEYS[5], 'ct', 'deleted', 'tail', 'fc')
  if not s[1] then return {'source_missing'} end
  if s[2] == '1' then return {'source_deleted'} end
  if after(ARGV[12], s[3] or '0-0') then return {'past_tail'} end
  local point = ARGV[12]
  local links = {ARGV[16], point}
  for m, b in string.gmatch(s[4] or '', '(%x+) (%d+%-%d+)') do
    links[#links + 1] = m
    links[#links + 1] = after(b, point) and point or b
  end
  if #links / 2 > MAX_FORK_DEPTH then return {'too_deep', int(MAX_FORK_DEPTH)} end
  chain = table.concat(links, ' ')
  if point == (s[3] or '0-0') then
    inherited_tail = point  -- the source's tail: its last entry
  else
    -- A point of the client's: the last entry at or before it, wherever in the chain (one
    -- entry read per stream: a fork at the tail, the usual one, reads none).
    for i = 1, #links, 2 do
      local data_key = i == 1 and KEYS[6] or key_of(KEYS[8], links[i], 'data')
      local last = redis.call('XREVRANGE', data_key, links[i + 1], '-', 'COUNT', 1)[1]
      if last and after(last[1], inherited_tail) then inherited_tail = last[1] end
    end
  end
end

-- This path's last stream went (expired) while forks still read it: the path stays theirs.
if redis.call('SCARD', KEYS[4]) > 0 then return {'conflict', 'deleted'} end
-- This path's last stream expired moments ago (its score not yet passed): its share is free,
-- and its reference on its source (a fork's) is given back.
if redis.call('ZSCORE', streams, member) then
  release(streams, sizes, usage, member)
  unref(streams, sizes, usage, member)
end
local bytes = #ARGV[14] + #ARGV[7]
local max_streams, max_bytes = tonumber(ARGV[17]), tonumber(ARGV[18])
if max_streams > 0 and redis.call('ZCARD', streams) >= max_streams then
  return {'quota', 'streams', ARGV[17]}
end
if max_bytes > 0 and (tonumber(redis.call('HGET', usage, 'bytes')) or 0) + bytes > max_bytes then
  return {'quota', 'bytes', ARGV[18]}
end

-- A stream deleted and made again starts empty: nothing of the old one is kept.
redis.call('DEL', data, producers, KEYS[4])
local tail = inherited_tail
if fork and ARGV[12] ~= '0-0' then
  -- An empty stream whose last id is the fork point: its own appends come after it.
  redis.call('XADD', data, 'MAXLEN', '0', ARGV[12], 'e', 'm', 'b', '')
end
if ARGV[14] ~= '' then
  local ms, seq = string.match(ARGV[12], '^(%d+)-(%d+)$')
  tail = redis.call('XADD', data, ms .. '-' .. string.format('%d', tonumber(seq) + 1), 'e', 'm',
    'b', ARGV[14])
end
if ARGV[7] ~= '' then
  tail = redis.call('XADD', data, '*', 'e', 'm', 'b', ARGV[7])
end
redis.call('HSET', meta, 'path', ARGV[1], 'ct', ARGV[2], 'ctr', ARGV[9], 'tail', tail,
  'inc', ARGV[8])
if fork then
  redis.call('HSET', meta, 'ff', ARGV[10], 'fo', ARGV[12], 'fs', ARGV[13], 'fc', chain)
  -- Its reference on its source, which is pinned (see _ds_quota).
  redis.call('SADD', KEYS[7], ARGV[1])
  redis.call('HSET', string.sub(streams, 1, -9) .. ':refs', member, ARGV[16] .. ' ' .. ARGV[1])
  redis.call('HSET', KEYS[5], 'pin', '1')
  redis.call('PERSIST', KEYS[6])
  redis.call('ZADD', streams, 'XX', 'inf', ARGV[16])
end
if ARGV[3] ~= '' then redis.call('HSET', meta, 'ttl', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', meta, 'exp', ARGV[4], 'exp_text', ARGV[5]) end
if ARGV[6] == '1' then
  redis.call('HSET', meta, 'closed', '1')
  redis.call('XADD', data, '*', 'e', 'close', 'b', '')
end
for _, key in ipairs({meta, data}) do
  if ARGV[3] ~= '' then
    redis.call('PEXPIRE', key, int(tonumber(ARGV[3]) * 1000))
  elseif ARGV[4] ~= '' then
    redis.call('PEXPIREAT', key, ARGV[4])
  end
end
-- Its score in the accounting: when its keys expire, or after (never before).
local expires = 'inf'
if ARGV[3] ~= '' then
  expires = int(clock_ms() + tonumber(ARGV[3]) * 1000)
elseif ARGV[4] ~= '' then
  expires = ARGV[4]
end
redis.call('ZADD', streams, expires, member)
redis.call('HSET', sizes, member, int(bytes))
redis.call('HINCRBY', usage, 'bytes', int(bytes))
sub_mark(KEYS[11], KEYS[12], KEYS[13], KEYS[14], ARGV[1], now_ms)
return {'created', tail, ARGV[6], ARGV[9]}
