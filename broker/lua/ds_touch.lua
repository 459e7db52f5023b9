-- ds_touch: start a Durable Streams stream's sliding TTL again (a read reached it), on its keys
-- and in its tenant's accounting, so that the tenant's share is given back only once the keys
-- are gone.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta
-- KEYS[2]  data          <space>:s:<digest>:data
-- KEYS[3]  producers     <space>:s:<digest>:producers
-- KEYS[4]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- ARGV[1]  ttl_ms        the stream's TTL in milliseconds
-- ARGV[2]  member        the stream's digest (its name in the tenant's accounting)
--
-- Returns  1 when the stream's TTL started again, 0 when it is gone or deleted (kept for its
--          forks: it has no expiry then)
-- Errors   none of its own.
-- A stream that forks read (pinned, see _ds_quota.lua) keeps its data and its score (inf):
-- its metadata alone expires.
local v = redis.call('HMGET', KEYS[1], 'deleted', 'pin')
if v[1] == '1' then return 0 end
local keep = tonumber(ARGV[1])
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[3], ARGV[1])
if v[2] then return 1 end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
-- Read after the PEXPIRE: never before the expiry it set.
redis.call('ZADD', KEYS[4], 'XX', string.format('%d', now_ms + keep), ARGV[2])
return 1
