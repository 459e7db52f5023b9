-- _ds_quota: the Durable Streams tenant accounting that ds_create, ds_append and ds_delete
-- share. Redis scripts cannot include each other: broker/scripts.py puts this text in place of
-- a script's "--! include _ds_quota" line before the script is registered. It is not a script
-- of its own: it defines functions only, and reads no KEYS or ARGV.
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
local function prune(streams, sizes, usage, now_ms)
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', streams, '-inf', int(now_ms - 2000))) do
    release(streams, sizes, usage, gone)
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
