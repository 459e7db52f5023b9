-- finish_attempt: end an attempt atomically: its last events, the turn's status, the attempt's
-- record and text, its promotion to canonical, the release of the lease and the retention
-- clock, all in one step, so a reader that sees the `end` event also sees the turn at rest.
--
-- Promotion is a compare-and-set: the attempt becomes canonical only if the canonical attempt is
-- still the one it started from (`base`); the previous canonical record is demoted in the same
-- step. (promote_attempt.lua is the same compare-and-set for a user's explicit choice.)
--
-- KEYS[1]  turn hash      {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  lease hash     {c:<conversation>}:lease:<turn_id>
-- KEYS[3]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[4]  tombstone      {c:<conversation>}:tombstone:<turn_id>
-- KEYS[5]  conversation turns  {c:<conversation>}:turns
-- ARGV[1]  token          the fencing token returned by claim_lease
-- ARGV[2]  attempt        the attempt number being finished
-- ARGV[3]  turn status    complete | interrupted | cancelled | failed | requires_action
-- ARGV[4]  record         JSON object of the attempt (n, strategy, status, reason, ...)
-- ARGV[5]  text           the attempt's text (for `continue`, the partial plus the continuation)
-- ARGV[6]  ttl_ms         retention of the finished turn's keys
-- ARGV[7]  tombstone_ms   how long the turn id stays taken (and answers "expired") after that
-- ARGV[8]  promote        "1" to make this attempt canonical, "0" not to
-- ARGV[9]  base           the canonical attempt number when this attempt started ("" for none)
-- ARGV[10], ARGV[11], ... pairs of (event type, JSON data); the last is the `end` event.
--                         Not counted against max_events: the terminal sentinel always fits.
--
-- Returns  {promotion, id, id, ...}  promotion: 1 promoted, 0 not asked, -1 refused (the
--          canonical attempt changed meanwhile); then the assigned entry ids
--          {0}  this token already finished this attempt (the call is sent again after its
--               reply was lost): nothing changed
-- Errors   "FENCED ..."  the lease expired or belongs to another token; nothing changed
local turn, lease, events, tombstone = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('HGET', lease, 'token') ~= ARGV[1] then
  local v = redis.call('HMGET', turn, 'fence', 'attempt', 'status')
  if v[1] == ARGV[1] and v[2] == ARGV[2] and v[3] ~= 'queued' and v[3] ~= 'streaming' then
    return {0}  -- no claim since this token's, and the attempt at rest: our own finish
  end
  return redis.error_reply('FENCED lease lost or taken over')
end
local result = {0}
for i = 10, #ARGV, 2 do
  result[#result + 1] = redis.call('XADD', events, '*', 'e', ARGV[i], 'd', ARGV[i + 1])
end
local n = ARGV[2]
local record = cjson.decode(ARGV[4])
record['canonical'] = false
if ARGV[8] == '1' then
  local current = redis.call('HGET', turn, 'canonical') or ''
  if current == ARGV[9] then
    if current ~= '' and current ~= n then
      local previous = cjson.decode(redis.call('HGET', turn, 'attempt:' .. current))
      previous['canonical'] = false
      redis.call('HSET', turn, 'attempt:' .. current, cjson.encode(previous))
    end
    redis.call('HSET', turn, 'canonical', n)
    record['canonical'] = true
    result[1] = 1
  else
    result[1] = -1
  end
end
redis.call('HSET', turn, 'status', ARGV[3], 'attempt:' .. n, cjson.encode(record),
  'text:' .. n, ARGV[5])
redis.call('HDEL', turn, 'cancel')
redis.call('DEL', lease)
local ttl = tonumber(ARGV[6])
redis.call('PEXPIRE', turn, ttl)
redis.call('PEXPIRE', events, ttl)
redis.call('SET', tombstone, n, 'PX', ttl + tonumber(ARGV[7]))
redis.call('PEXPIRE', KEYS[5], ttl + tonumber(ARGV[7]))
return result
