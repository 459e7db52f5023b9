-- ds_delete: delete a Durable Streams stream, or soft-delete it while forks of it live.
--
-- A stream with forks (their paths in its forks set, pruned of expired ones by the caller just
-- before) keeps its metadata, marked deleted, and its data, which its forks read: its path
-- answers 410 and cannot be created again until its last fork goes, and it keeps its share of
-- its tenant's quota until then (its bytes are still in Redis). A stream without forks goes at
-- once with its share; a fork gives its reference on its source back, and a source gone (deleted
-- or expired) whose last fork this was goes too, up the chain (see _ds_quota): one step, no
-- moment when a reference is left without its fork.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta
-- KEYS[2]  data          <space>:s:<digest>:data
-- KEYS[3]  producers     <space>:s:<digest>:producers
-- KEYS[4]  forks         <space>:s:<digest>:forks       (set of the forks' paths)
-- KEYS[5]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- KEYS[6]  sizes         <space>:sizes    (hash: counted stream digest -> bytes)
-- KEYS[7]  usage         <space>:usage    (hash: bytes, the tenant's in all)
--          and, built from KEYS[5]: the tenant's refs hash and the keys of the source's chain
-- ARGV[1]  member        the stream's digest (its name in the tenant's accounting)
--
-- Returns  {"missing"}              no such stream
--          {"gone"}                 deleted already, its forks still live (410)
--          {"soft"}                 marked deleted: forks of it live
--          {"deleted", source}      deleted; source: the path of the stream it forked when
--                                   that fork was made by copy, before forks read by reference
--                                   (the caller gives that reference back: ds_fork_ref), else ""
-- Errors   none of its own.
-- Uses     _ds_quota.lua (release, unref), put in place below.
--! include _ds_quota
local meta, data, producers, forks = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local streams, sizes, usage, member = KEYS[5], KEYS[6], KEYS[7], ARGV[1]
local v = redis.call('HMGET', meta, 'ct', 'deleted', 'ff')
if not v[1] then return {'missing'} end
if v[2] == '1' then return {'gone'} end
redis.call('DEL', producers)
if redis.call('SCARD', forks) > 0 then
  redis.call('HSET', meta, 'deleted', '1', 'pin', '1')
  redis.call('PERSIST', meta)
  redis.call('PERSIST', data)
  redis.call('ZADD', streams, 'XX', 'inf', member)
  return {'soft'}
end
redis.call('DEL', meta, data, forks)
release(streams, sizes, usage, member)
if unref(streams, sizes, usage, member) then return {'deleted', ''} end
return {'deleted', v[3] or ''}
