-- start_attempt: begin a user-chosen attempt (continue or regenerate) of a turn at rest.
--
-- KEYS[1]  turn hash      {c:<conversation>}:turn:<turn_id>
-- KEYS[2]  event stream   {c:<conversation>}:events:<turn_id>
-- ARGV[1]  strategy       continue | regenerate
--
-- Returns  {"started", attempt}        the new attempt's number; the turn is queued again
--          {"busy", status}            a generation is queued, running or awaiting approval
--          {"not_allowed", reason}     the strategy does not fit the turn's state
--          {"missing"}                 no such turn
-- Errors   none of its own.
local turn, events = KEYS[1], KEYS[2]
local v = redis.call('HMGET', turn, 'status', 'attempt', 'response_format', 'canonical')
local status, attempt, format, canonical = v[1], v[2], v[3], v[4]
if not status then
  return {'missing'}
end
if status == 'queued' or status == 'streaming' or status == 'awaiting_approval' then
  return {'busy', status}
end
local strategy = ARGV[1]
if strategy == 'continue' then
  if format == 'json' or format == 'json_schema' then
    return {'not_allowed', 'continue is not available for response_format ' .. format .. ': regenerate'}
  end
  if status ~= 'interrupted' and status ~= 'cancelled' then
    return {'not_allowed', 'continue needs an interrupted or cancelled turn, this one is ' .. status}
  end
  if redis.call('HSTRLEN', turn, 'text:' .. attempt) == 0 then
    return {'not_allowed', 'the last attempt has no text to continue: regenerate'}
  end
end
local n = tonumber(attempt) + 1
local record = {n = n, strategy = strategy, status = 'queued', reason = cjson.null,
  canonical = false, base = canonical or '', from = tonumber(attempt)}
redis.call('HSET', turn, 'status', 'queued', 'attempt', n, 'enqueued', 0,
  'attempt:' .. n, cjson.encode(record))
redis.call('HDEL', turn, 'cancel')
redis.call('PERSIST', turn)
redis.call('PERSIST', events)
return {'started', tostring(n)}
