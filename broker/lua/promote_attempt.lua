-- promote_attempt: make an attempt the turn's canonical answer, by compare-and-set.
--
-- The previous canonical attempt is demoted in the same step. Two clients promoting from the
-- same expected state cannot both win: the second finds the canonical changed and is refused.
--
-- KEYS[1]  turn hash   {c:<conversation>}:turn:<turn_id>
-- ARGV[1]  attempt     the attempt number to promote
-- ARGV[2]  expected    the canonical attempt number the caller saw ("" for none)
--
-- Returns  {"promoted", attempt}
--          {"conflict", current}       the canonical attempt is not `expected`
--          {"not_allowed", reason}     the turn is running, or the attempt has no answer (an
--                                      attempt that ended requires_action has one: its
--                                      client tool calls, even without text)
--          {"missing"}                 no such turn or attempt
-- Errors   none of its own.
local turn = KEYS[1]
local status = redis.call('HGET', turn, 'status')
if not status then
  return {'missing'}
end
local raw = redis.call('HGET', turn, 'attempt:' .. ARGV[1])
if not raw then
  return {'missing'}
end
if status == 'queued' or status == 'streaming' then
  return {'not_allowed', 'a generation is running'}
end
local record = cjson.decode(raw)
local calls = record['status'] == 'requires_action'
local empty = redis.call('HSTRLEN', turn, 'text:' .. ARGV[1]) == 0
if record['status'] == 'failed' or (empty and not calls) then
  return {'not_allowed', 'the attempt has no answer'}
end
local current = redis.call('HGET', turn, 'canonical') or ''
if current ~= ARGV[2] then
  return {'conflict', current}
end
if current ~= '' and current ~= ARGV[1] then
  local previous = cjson.decode(redis.call('HGET', turn, 'attempt:' .. current))
  previous['canonical'] = false
  redis.call('HSET', turn, 'attempt:' .. current, cjson.encode(previous))
end
record['canonical'] = true
redis.call('HSET', turn, 'canonical', ARGV[1], 'attempt:' .. ARGV[1], cjson.encode(record))
return {'promoted', ARGV[1]}
