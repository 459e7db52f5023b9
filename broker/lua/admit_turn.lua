-- admit_turn: let a tenant start a generation (a turn or a new attempt) under its rate and
-- stream limits, on the Redis server clock. Both limits are checked before either is charged, so
-- a refusal costs nothing.
--
-- KEYS[1]  rate           {t:<tenant>}:rate  (hash: tokens, ts = last refill in ms)
-- KEYS[2]  live           {t:<tenant>}:live  (sorted set: member -> deadline in ms)
-- ARGV[1]  rate_per_s     tokens added per second; 0 = no rate limit
-- ARGV[2]  burst          the bucket's size
-- ARGV[3]  cost           tokens this call takes (0: only the stream cap applies)
-- ARGV[4]  max_live       turns queued or generating at once; 0 = no limit
-- ARGV[5]  member         "<conversation> <turn> <attempt>": the attempt this admits
-- ARGV[6]  slot_ttl_ms    how long the member counts unless refreshed or released
--
-- Returns  {1, 0, ""}                  admitted (the member counts until released or expired)
--          {0, retry_after_ms, reason} refused; reason is "rate" or "streams"
-- Errors   none of its own.
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local max_live = tonumber(ARGV[4])
local member = ARGV[5]

if max_live > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if not redis.call('ZSCORE', KEYS[2], member) and redis.call('ZCARD', KEYS[2]) >= max_live then
    return {0, 1000, 'streams'}
  end
end

if rate > 0 and cost > 0 then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now_ms
  if now_ms > ts then
    tokens = math.min(burst, tokens + (now_ms - ts) * rate / 1000)
  end
  if tokens < cost then
    return {0, math.ceil((cost - tokens) * 1000 / rate), 'rate'}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - cost), 'ts', now_ms)
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
end

if max_live > 0 then
  redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[6]), member)
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]))
end
return {1, 0, ''}
