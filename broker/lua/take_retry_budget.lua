-- take_retry_budget: spend one silent retry from a session's budget, a sliding window on the
-- Redis server clock.
--
-- KEYS[1]  budget         {s:<session>}:retries (sorted set of retry times)
-- ARGV[1]  budget         retries allowed per window
-- ARGV[2]  window_ms      the window's length
-- ARGV[3]  member         a unique id for this retry
--
-- Returns  1 when the retry may go ahead, 0 when the budget is spent
-- Errors   none of its own.
local key = KEYS[1]
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - tonumber(ARGV[2]))
if redis.call('ZCARD', key) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', key, now_ms, ARGV[3])
redis.call('PEXPIRE', key, ARGV[2])
return 1
