-- ds_fork_ref: give the reference of a fork made by copy (before forks read by reference) on
-- its source back: the fork is deleted.
--
-- Such a fork is counted in its source's forks set only (no entry in the tenant's refs hash),
-- so ds_delete leaves its reference to this script. A source with no fork left is settled (see
-- _ds_quota): one deleted or expired goes for good with its share, one still there is unpinned.
--
-- KEYS[1]  metadata      the source's <space>:s:<digest>:meta
-- KEYS[2]  forks         the source's <space>:s:<digest>:forks
-- KEYS[3]  data          the source's <space>:s:<digest>:data
-- KEYS[4]  producers     the source's <space>:s:<digest>:producers
-- KEYS[5]  streams       <space>:streams  (sorted set: counted stream digest -> expiry ms)
-- KEYS[6]  sizes         <space>:sizes    (hash: counted stream digest -> bytes)
-- KEYS[7]  usage         <space>:usage    (hash: bytes, the tenant's in all)
--          and, built from KEYS[5]: the tenant's refs hash and the keys of the source's chain
-- ARGV[1]  fork          the fork's path
-- ARGV[2]  member        the source's digest
--
-- Returns  {"kept"}               the source stays
--          {"deleted", source}    it was the gone source's last fork: the source went too;
--                                 source: the stream it forked by copy ("" for none, or for a
--                                 reference given back here already)
-- Errors   none of its own.
-- Uses     _ds_quota.lua (settle, unref), put in place below.
--! include _ds_quota
local streams, sizes, usage, member = KEYS[5], KEYS[6], KEYS[7], ARGV[2]
local ff = redis.call('HGET', KEYS[1], 'ff')
redis.call('SREM', KEYS[2], ARGV[1])
if not settle(streams, sizes, usage, member) then return {'kept'} end
if unref(streams, sizes, usage, member) then return {'deleted', ''} end
return {'deleted', ff or ''}
