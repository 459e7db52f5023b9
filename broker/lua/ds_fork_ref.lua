-- ds_fork_ref: take or give back a fork's reference on its source, in the source's slot.
--
-- A fork is made only after its reference is taken (so that its source cannot be deleted
-- under it), and gives it back when it is deleted, or when its creation was refused. A source
-- deleted while it had forks goes for good with its last reference.
--
-- KEYS[1]  metadata      the source's <prefix>:{ds:<digest>}:meta
-- KEYS[2]  forks         the source's <prefix>:{ds:<digest>}:forks
-- KEYS[3]  data          the source's <prefix>:{ds:<digest>}:data
-- KEYS[4]  producers     the source's <prefix>:{ds:<digest>}:producers
-- ARGV[1]  operation     "take" or "give"
-- ARGV[2]  fork          the fork's scoped path
--
-- Returns  {"taken", added}       (take) added: 1 when the fork was not counted yet
--          {"missing"}            (take) no such source
--          {"gone"}               (take) the source is deleted (its forks still live)
--          {"kept"}               (give) the source stays
--          {"deleted", source}    (give) it was the deleted source's last fork: the source
--                                 went too; source: the stream it forked ("" for none)
-- Errors   none of its own.
local meta, forks = KEYS[1], KEYS[2]
local v = redis.call('HMGET', meta, 'ct', 'deleted', 'ff')
if ARGV[1] == 'take' then
  if not v[1] then return {'missing'} end
  if v[2] == '1' then return {'gone'} end
  return {'taken', redis.call('SADD', forks, ARGV[2])}
end
redis.call('SREM', forks, ARGV[2])
if v[2] == '1' and redis.call('SCARD', forks) == 0 then
  redis.call('DEL', meta, forks, KEYS[3], KEYS[4])
  return {'deleted', v[3] or ''}
end
return {'kept'}
