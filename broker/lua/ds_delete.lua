-- ds_delete: delete a Durable Streams stream, or soft-delete it while forks of it live.
--
-- A stream with forks (their paths in its forks set, pruned of expired ones by the caller just
-- before) keeps its metadata, marked deleted: its path answers 410 and cannot be created again
-- until its last fork goes (ds_unfork). Its data goes either way: a fork holds a copy of what
-- it inherited.
--
-- KEYS[1]  metadata      <prefix>:{ds:<digest>}:meta
-- KEYS[2]  data          <prefix>:{ds:<digest>}:data
-- KEYS[3]  producers     <prefix>:{ds:<digest>}:producers
-- KEYS[4]  forks         <prefix>:{ds:<digest>}:forks       (set of the forks' scoped paths)
--
-- Returns  {"missing"}              no such stream
--          {"gone"}                 deleted already, its forks still live (410)
--          {"soft"}                 marked deleted: forks of it live
--          {"deleted", source}      deleted; source: the scoped path of the stream it forked
--                                   ("" for none), whose forks set the caller updates
-- Errors   none of its own.
local meta, data, producers, forks = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local v = redis.call('HMGET', meta, 'ct', 'deleted', 'ff')
if not v[1] then return {'missing'} end
if v[2] == '1' then return {'gone'} end
redis.call('DEL', data, producers)
if redis.call('SCARD', forks) > 0 then
  redis.call('HSET', meta, 'deleted', '1')
  redis.call('PERSIST', meta)
  return {'soft'}
end
redis.call('DEL', meta, forks)
return {'deleted', v[3] or ''}
