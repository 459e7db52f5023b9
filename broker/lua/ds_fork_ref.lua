-- ds_fork_ref: give a fork's reference on its source back (the fork is deleted).
--
-- A fork is counted in its source's forks set when it is made (ds_create), so that its source
-- cannot be deleted under it. A source deleted while it had forks goes for good with its last
-- reference (it gave its share of its tenant's quota back when it was deleted).
--
-- KEYS[1]  metadata      the source's <space>:s:<digest>:meta
-- KEYS[2]  forks         the source's <space>:s:<digest>:forks
-- KEYS[3]  data          the source's <space>:s:<digest>:data
-- KEYS[4]  producers     the source's <space>:s:<digest>:producers
-- ARGV[1]  fork          the fork's path
--
-- Returns  {"kept"}               the source stays
--          {"deleted", source}    it was the deleted source's last fork: the source went too;
--                                 source: the stream it forked ("" for none)
-- Errors   none of its own.
local meta, forks = KEYS[1], KEYS[2]
local v = redis.call('HMGET', meta, 'ct', 'deleted', 'ff')
redis.call('SREM', forks, ARGV[1])
if v[2] == '1' and redis.call('SCARD', forks) == 0 then
  redis.call('DEL', meta, forks, KEYS[3], KEYS[4])
  return {'deleted', v[3] or ''}
end
return {'kept'}
