-- ds_append: a group of appends to one Durable Streams stream, in order, each an append, a
-- close, or both, atomically, with the idempotent producer's check (a retried batch is answered,
-- not written twice; a stale epoch is fenced) and the Stream-Seq check. The appends of a group
-- are those that arrived together (broker.durable_store.groups): each is checked and answered
-- as if it were called alone, after the ones before it, so a refused one leaves the others be.
--
-- The order of the checks is the protocol's: a closed stream first (unless this is the very
-- request that closed it, retried), then the content type, then the producer, then Stream-Seq.
-- Closing writes a last "close" entry after the data, so that live readers wake up (and an
-- append after the close in the same group is refused as closed).
--
-- The tenant's quota: every append takes a token of the tenant's append rate (before anything
-- else: a refused append does nothing), and needs room for its bytes; streams whose expiry
-- passed (by more than two seconds: their keys are surely gone) give their share back first.
-- A sliding TTL moves the stream's expiry in the tenant's accounting too.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta
-- KEYS[2]  data          <space>:s:<digest>:data
-- KEYS[3]  producers     <space>:s:<digest>:producers
-- KEYS[4]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- KEYS[5]  sizes         <space>:sizes    (hash: counted stream digest -> bytes)
-- KEYS[6]  usage         <space>:usage    (hash: bytes; tokens, ts: the append rate's bucket)
-- KEYS[7..10]           the tenant's subscriptions: <space>:subs, :subs:links, :subs:due,
--                        :subs:marks (see _ds_sub_mark.lua: an append marks those it concerns)
--          (<space> is the tenant's {ds:t:<tenant>}, or {ds:open}: one slot for all)
-- ARGV[1]  max entries   the most appends a stream may hold (BROKER_DS_MAX_APPENDS)
-- ARGV[2]  member        the stream's digest (its name in the tenant's accounting)
-- ARGV[3]  max bytes     the tenant's most bytes (BROKER_DS_TENANT_MAX_BYTES); 0: no limit
-- ARGV[4]  rate          the tenant's appends per second (BROKER_DS_TENANT_APPENDS_PER_S); 0: none
-- ARGV[5]  burst         the rate's bucket (BROKER_DS_TENANT_APPEND_BURST)
-- ARGV[6]  path          the stream's path (for the subscriptions' patterns)
-- ARGV[7..] the appends, 7 values each, in order (ARGV[a] .. ARGV[a + 6] for each a):
--   a      content type  the request's, normalized; "" for a close without a body
--   a + 1  body          the entry's payload (its bytes, kept as they are: field b); "" to
--                        close without appending
--   a + 2  close         "1" to close the stream after the append, else ""
--   a + 3  producer id   "" when the request has no producer headers
--   a + 4  epoch         the producer's epoch (a whole number), when a + 3 is set
--   a + 5  seq           the producer's sequence number, when a + 3 is set
--   a + 6  stream seq    the Stream-Seq header, or "" for none
--
-- Returns  one reply per append, in their order, each one of:
--          {"ok", tail, closed}             appended (and/or closed); tail: the last entry id
--          {"missing"}                      no such stream
--          {"gone"}                         the stream is deleted (forks of it live)
--          {"closed", tail}                 the stream is closed: this append is refused
--          {"closed_again", tail}           a close of a closed stream (idempotent)
--          {"duplicate", tail, seq, closed} the producer sent this batch already (seq: the
--                                           highest it had accepted)
--          {"content_type", stream's type}  the request's content type is not the stream's
--          {"stale_epoch", epoch}           a newer epoch of the producer exists (fenced)
--          {"epoch_seq"}                    a new epoch must start at seq 0
--          {"gap", expected, received}      the producer skipped sequence numbers
--          {"stream_seq", last}             Stream-Seq is not past the last one
--          {"full", max}                    the stream holds BROKER_DS_MAX_APPENDS appends
--          {"rate", retry_after_ms}         the tenant appends faster than its rate
--          {"quota", "bytes", max}          the tenant's bytes would pass its quota
-- Errors   none of its own.
-- Uses     _ds_quota.lua (clock_ms, int, release, prune, take_token) and _ds_sub_mark.lua
--          (sub_mark), put in place below; prune gives the references of forks that expired
--          back (keys built from KEYS[4]).
--! include _ds_quota
--! include _ds_sub_mark
local meta, data, producers = KEYS[1], KEYS[2], KEYS[3]
local streams, sizes, usage, member = KEYS[4], KEYS[5], KEYS[6], ARGV[2]
local max_entries, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[3])
local rate, burst = tonumber(ARGV[4]), tonumber(ARGV[5])

-- Expired streams give their share back, once for the group.
prune(streams, sizes, usage, clock_ms())

-- Whether a sorts at or before b, byte by byte (Lua's own comparison follows the locale).
local function at_or_before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a <= #b
end

-- One append: its values are ARGV[a] .. ARGV[a + 6]; its reply as listed above.
local function append(a)
  local ctype, body, close = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local producer, epoch_arg, seq_arg, sseq = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local wait_ms = take_token(usage, rate, burst, clock_ms())
  if wait_ms then return {'rate', wait_ms} end

  local v = redis.call('HMGET', meta, 'ct', 'closed', 'tail', 'cp', 'sseq', 'ttl', 'deleted', 'pin')
  if not v[1] then return {'missing'} end
  if v[7] == '1' then return {'gone'} end

  -- A sliding TTL starts again with every request that reaches the stream, refused or not; an
  -- absolute expiry is copied onto keys made since (the data, the producers). A stream that
  -- forks read (pinned, see _ds_quota) keeps its data and its score: its metadata alone expires.
  local function keep_alive()
    local keep = v[6] and tonumber(v[6]) * 1000 or redis.call('PTTL', meta)
    if keep > 0 then
      redis.call('PEXPIRE', meta, int(keep))
      if redis.call('EXISTS', producers) == 1 then redis.call('PEXPIRE', producers, int(keep)) end
      if v[8] then return end
      if redis.call('EXISTS', data) == 1 then redis.call('PEXPIRE', data, int(keep)) end
      if v[6] then redis.call('ZADD', streams, 'XX', int(clock_ms() + keep), member) end
    end
  end
  if v[6] then keep_alive() end
  local tail = v[3] or '0-0'
  local epoch, seq = tonumber(epoch_arg), tonumber(seq_arg)
  local tuple = producer ~= '' and (producer .. ' ' .. epoch_arg .. ' ' .. seq_arg) or ''
  if v[2] == '1' then
    if tuple ~= '' and v[4] == tuple then return {'duplicate', tail, seq_arg, '1'} end
    if body == '' and close == '1' and tuple == '' then return {'closed_again', tail} end
    return {'closed', tail}
  end
  if body ~= '' and ctype ~= v[1] then return {'content_type', v[1]} end
  local state = nil
  if producer ~= '' then
    local held = redis.call('HGET', producers, producer)
    if not held then
      if seq ~= 0 then return {'gap', '0', seq_arg} end
    else
      local sep = string.find(held, ' ', 1, true)
      local held_epoch, last = tonumber(string.sub(held, 1, sep - 1)), tonumber(string.sub(held, sep + 1))
      if epoch < held_epoch then return {'stale_epoch', string.sub(held, 1, sep - 1)} end
      if epoch > held_epoch then
        if seq ~= 0 then return {'epoch_seq'} end
      elseif seq <= last then
        return {'duplicate', tail, string.sub(held, sep + 1), ''}
      elseif seq ~= last + 1 then
        return {'gap', string.format('%d', last + 1), seq_arg}
      end
    end
    state = epoch_arg .. ' ' .. seq_arg
  end
  if sseq ~= '' then
    if v[5] and at_or_before(sseq, v[5]) then return {'stream_seq', v[5]} end
  end
  if body ~= '' then
    if redis.call('XLEN', data) >= max_entries then return {'full', ARGV[1]} end
    if max_bytes > 0 and (tonumber(redis.call('HGET', usage, 'bytes')) or 0) + #body > max_bytes then
      return {'quota', 'bytes', ARGV[3]}
    end
    tail = redis.call('XADD', data, '*', 'e', 'm', 'b', body)
    redis.call('HSET', meta, 'tail', tail)
    redis.call('HINCRBY', sizes, member, #body)
    redis.call('HINCRBY', usage, 'bytes', #body)
  end
  if state then redis.call('HSET', producers, producer, state) end
  if sseq ~= '' then redis.call('HSET', meta, 'sseq', sseq) end
  local closed = ''
  if close == '1' then
    closed = '1'
    redis.call('HSET', meta, 'closed', '1', 'cp', tuple)
    redis.call('XADD', data, '*', 'e', 'close', 'b', '')
  end
  keep_alive()
  return {'ok', tail, closed}
end

local replies, wrote = {}, false
for a = 7, #ARGV, 7 do
  local reply = append(a)
  replies[#replies + 1] = reply
  if reply[1] == 'ok' then wrote = true end
end
-- The subscriptions this stream concerns are marked once for the group, if anything was
-- written (a refused append marks nothing).
if wrote then sub_mark(KEYS[7], KEYS[8], KEYS[9], KEYS[10], ARGV[6], clock_ms()) end
return replies
