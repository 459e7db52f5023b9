-- _ds_quota: the Durable Streams tenant accounting, and the forks' references, that the ds_*
-- scripts share. Redis scripts cannot include each other: broker/scripts.py puts this text in
-- place of a script's "--! include _ds_quota" line before the script is registered. It is not a
-- script of its own: it defines functions only, and reads no KEYS or ARGV.
--
-- A fork reads what it inherits from its source's stream (and its source's source, up the
-- chain): it holds a reference on its source, in the source's forks set (its path) and in the
-- tenant's refs hash (its digest -> "<source digest> <its path>"). A stream that forks
-- reference is pinned: its data and forks set have no expiry, its metadata says "pin", and its
-- score in the accounting is inf (its share stays charged: its bytes are still in Redis); its
-- metadata keeps its own expiry. The functions below reach the streams of a chain by their
-- digests, their keys built from the accounting's (<space>:streams): all in the tenant's slot.
--
-- clock_ms()                              the server's clock in ms. A key's expiry is counted
--                                         from when its PEXPIRE runs (or from the script's
--                                         start, on servers that freeze time in scripts), so a
--                                         score read after the PEXPIRE is never before it.
-- int(n)                                  a whole number as Redis takes it (Lua would write
--                                         1e+15, or -0)
-- release(streams, sizes, usage, gone)    the stream ``gone`` gives its share of its tenant's
--                                         bytes and streams back
-- prune(streams, sizes, usage, now_ms)    streams whose expiry passed give their share back
--                                         (their scores are never before their keys' expiry,
--                                         and two seconds more leave no doubt that the keys
--                                         are gone)
-- take_token(usage, rate, burst, now_ms)  takes a token of the tenant's append rate (``rate``
--                                         per second, a bucket of ``burst``; 0: no limit):
--                                         nil when taken, else the ms to wait, as text
-- key_of(streams, member, part)          the key ``part`` (meta, data, producers, forks) of
--                                         stream ``member`` of the tenant of ``streams``
-- settle(streams, sizes, usage, member)   stream ``member`` lost a reference: with none left, a
--                                         live stream is unpinned (its data takes its
--                                         metadata's expiry again, and its score), one gone
--                                         (deleted, or its metadata expired) goes for good
--                                         with its share; true when it went
-- unref(streams, sizes, usage, member)    stream ``member`` (a fork) is gone: its reference on
--                                         its source is given back, and a source gone for good
--                                         gives its own back, up the chain (at most
--                                         MAX_FORK_DEPTH levels); true when it held one
local function clock_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
local function release(streams, sizes, usage, gone)
  local held = tonumber(redis.call('HGET', sizes, gone)) or 0
  if held > 0 and redis.call('HINCRBY', usage, 'bytes', int(-held)) < 0 then
    redis.call('HSET', usage, 'bytes', 0)
  end
  redis.call('HDEL', sizes, gone)
  redis.call('ZREM', streams, gone)
end
local MAX_FORK_DEPTH = 16
local function key_of(streams, member, part)
  return string.sub(streams, 1, -9) .. ':s:' .. member .. ':' .. part
end
local function settle(streams, sizes, usage, member)
  local forks = key_of(streams, member, 'forks')
  if redis.call('SCARD', forks) > 0 then return false end
  local meta, data = key_of(streams, member, 'meta'), key_of(streams, member, 'data')
  local v = redis.call('HMGET', meta, 'ct', 'deleted', 'pin')
  if v[1] and v[2] ~= '1' then
    if v[3] then
      redis.call('HDEL', meta, 'pin')
      local left = redis.call('PTTL', meta)
      if left > 0 then
        redis.call('PEXPIRE', data, left)
        redis.call('ZADD', streams, 'XX', int(clock_ms() + left), member)
      end
    end
    return false
  end
  redis.call('DEL', meta, data, forks, key_of(streams, member, 'producers'))
  release(streams, sizes, usage, member)
  return true
end
local function unref(streams, sizes, usage, member)
  local refs = string.sub(streams, 1, -9) .. ':refs'
  local held = false
  for _ = 0, MAX_FORK_DEPTH do
    local ref = redis.call('HGET', refs, member)
    if not ref then return held end
    held = true
    redis.call('HDEL', refs, member)
    local source, path = string.match(ref, '^(%x+) (.*)$')
    redis.call('SREM', key_of(streams, source, 'forks'), path)
    if not settle(streams, sizes, usage, source) then return held end
    member = source
  end
  return held
end
local function prune(streams, sizes, usage, now_ms)
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', streams, '-inf', int(now_ms - 2000))) do
    release(streams, sizes, usage, gone)
    unref(streams, sizes, usage, gone)
  end
end
local function take_token(usage, rate, burst, now_ms)
  if rate <= 0 then return nil end
  local state = redis.call('HMGET', usage, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now_ms
  if now_ms > ts then tokens = math.min(burst, tokens + (now_ms - ts) * rate / 1000) end
  if tokens < 1 then return tostring(math.ceil((1 - tokens) * 1000 / rate)) end
  redis.call('HSET', usage, 'tokens', tostring(tokens - 1), 'ts', int(now_ms))
  return nil
end
