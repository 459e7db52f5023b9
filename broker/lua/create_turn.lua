-- create_turn: create a turn once; a second call with the same turn id finds the first.
--
-- KEYS[1]  turn hash            {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  tombstone            {c:<conversation>}:tombstone:<turn_id>
-- KEYS[3]  conversation turns   {c:<conversation>}:turns (sorted set, by creation time)
-- ARGV[1]  request fingerprint  hex SHA-256 of the canonical request
-- ARGV[2]  stream id            server-minted, used only when the turn is new
-- ARGV[3]  conversation id
-- ARGV[4]  turn id
-- ARGV[5]  request              canonical JSON of the request
-- ARGV[6]  session              the retry-budget session (the conversation id by default)
-- ARGV[7]  attempt record       JSON of attempt 1 ({"n":1,"strategy":"initial",...})
-- ARGV[8]  response format      text | json | json_schema
-- ARGV[9]  notify               the turn's own completion webhook URL ("" or absent: none)
--
-- Returns  {"created", stream_id, status, attempt, created_ms}
--          {"exists",  stream_id, status, attempt, created_ms, enqueued}   same fingerprint
--          {"conflict"}                                                    other fingerprint
--          {"expired"}                       the turn finished and its data expired
-- Errors   none of its own.
local turn = KEYS[1]
local existing = redis.call('HGET', turn, 'fingerprint')
if existing then
  if existing ~= ARGV[1] then
    return {'conflict'}
  end
  local v = redis.call('HMGET', turn, 'stream_id', 'status', 'attempt', 'created_ms', 'enqueued')
  return {'exists', v[1], v[2], v[3], v[4], v[5] or '0'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'expired'}
end
local now = redis.call('TIME')
local created_ms = tostring(tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', turn,
  'fingerprint', ARGV[1], 'stream_id', ARGV[2], 'conversation_id', ARGV[3], 'turn_id', ARGV[4],
  'request', ARGV[5], 'session', ARGV[6], 'status', 'queued', 'attempt', 1, 'fence', 0,
  'enqueued', 0, 'created_ms', created_ms, 'attempt:1', ARGV[7], 'response_format', ARGV[8])
if ARGV[9] and ARGV[9] ~= '' then
  redis.call('HSET', turn, 'notify', ARGV[9])
end
redis.call('ZADD', KEYS[3], created_ms, ARGV[4])
redis.call('PERSIST', KEYS[3])
return {'created', ARGV[2], 'queued', '1', created_ms}
