-- ds_delete: delete a Durable Streams stream, or soft-delete it while forks of it live.
--
-- A stream with forks (their paths in its forks set, pruned of expired ones by the caller just
-- before) keeps its metadata, marked deleted: its path answers 410 and cannot be created again
-- until its last fork goes (ds_fork_ref). Its data goes either way (a fork holds a copy of what
-- it inherited), and so does its share of its tenant's quota.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta
-- KEYS[2]  data          <space>:s:<digest>:data
-- KEYS[3]  producers     <space>:s:<digest>:producers
-- KEYS[4]  forks         <space>:s:<digest>:forks       (set of the forks' paths)
-- KEYS[5]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- KEYS[6]  sizes         <space>:sizes    (hash: counted stream digest -> bytes)
-- KEYS[7]  usage         <space>:usage    (hash: bytes, the tenant's in all)
-- ARGV[1]  member        the stream's digest (its name in the tenant's accounting)
--
-- Returns  {"missing"}              no such stream
--          {"gone"}                 deleted already, its forks still live (410)
--          {"soft"}                 marked deleted: forks of it live
--          {"deleted", source}      deleted; source: the path of the stream it forked ("" for
--                                   none), whose forks set the caller updates
-- Errors   none of its own.
-- Uses     _ds_quota.lua (release), put in place below.
--! include _ds_quota
local meta, data, producers, forks = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local v = redis.call('HMGET', meta, 'ct', 'deleted', 'ff')
if not v[1] then return {'missing'} end
if v[2] == '1' then return {'gone'} end
redis.call('DEL', data, producers)
release(KEYS[5], KEYS[6], KEYS[7], ARGV[1])
if redis.call('SCARD', forks) > 0 then
  redis.call('HSET', meta, 'deleted', '1')
  redis.call('PERSIST', meta)
  return {'soft'}
end
redis.call('DEL', meta, forks)
return {'deleted', v[3] or ''}
