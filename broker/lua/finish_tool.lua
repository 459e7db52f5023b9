-- finish_tool: store a claimed call's outcome, once, for the holder of the current token.
--
-- A late finish by the current holder is accepted even after its lease ran out, as long as no
-- one reclaimed the slot; a zombie (an older token) is fenced. Failures are stored like results
-- so that a replay gives the same answer; a stored outcome never changes.
--
-- KEYS[1]  slot hash   {c:<conversation>}:tool:<turn_id>:<tool>:<ordinal>
-- ARGV[1]  token       the token from claim_tool (or the reclaim)
-- ARGV[2]  outcome     completed | failed
-- ARGV[3]  payload     JSON: the result (completed) or the error (failed)
--
-- Returns  {"ok"}
--          {"fenced", state}   the token is not current, or the outcome is already stored
-- Errors   none of its own.
local slot = KEYS[1]
local v = redis.call('HMGET', slot, 'token', 'state')
if v[1] ~= ARGV[1] or v[2] ~= 'in_flight' then
  return {'fenced', v[2] or ''}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local field = 'error'
if ARGV[2] == 'completed' then
  field = 'result'
end
redis.call('HSET', slot, 'state', ARGV[2], field, ARGV[3], 'finished_ms', now_ms)
return {'ok'}
