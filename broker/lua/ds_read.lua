-- ds_read: a catch-up read of one Durable Streams stream's own entries past a place: their
-- payloads alone, with the metadata, in one round trip. The broker answers a catch-up read with
-- the payloads and the place after the last one; an XRANGE would send each entry's id and
-- fields too, an object each for the broker to make and drop. What a fork inherits from its
-- sources is not read here (the broker reads it entry by entry), nor are payloads kept as text
-- by older releases (field d): the script stops before one.
--
-- KEYS[1]  metadata      <space>:s:<digest>:meta
-- KEYS[2]  data          <space>:s:<digest>:data
--          (<space> is the tenant's {ds:t:<tenant>}, or {ds:open}: one slot for all)
-- ARGV[1]  after         the entry id the read starts after ("0-0": from the first)
-- ARGV[2]  max bytes     the most payload bytes to take (the first entry is taken whatever
--                        its size)
-- ARGV[3]  max entries   the most entries to take (a bound on the time the call holds Redis)
-- ARGV[4]  with meta     "1": the stream's metadata first (HMGET of the fields below), "": not
--
-- Returns  {meta, last, payloads, state}
--          meta      with ARGV[4]: the values of HMGET metadata ctr tail closed inc ttl exp
--                    exp_text deleted fc (nil for a missing field; ctr nil: no such stream,
--                    and nothing is read); else an empty array
--          last      the id of the last entry taken ("" when none)
--          payloads  the payloads of the entries taken, in order
--          state     "tail": every entry past ARGV[1] was taken; "full": the next entry would
--                    pass ARGV[2]; "more": ARGV[3] entries were taken and more may follow;
--                    "ended": the stream's close entry follows the last one taken; "text":
--                    the next entry's payload is kept as text (field d): the broker reads it
-- Errors   none of its own.
local meta = {}
if ARGV[4] == '1' then
  meta = redis.call('HMGET', KEYS[1], 'ctr', 'tail', 'closed', 'inc', 'ttl', 'exp', 'exp_text',
    'deleted', 'fc')
  if not meta[1] then return {meta, '', {}, 'tail'} end
end
local limit = tonumber(ARGV[2])
local most = tonumber(ARGV[3])
local payloads, size, taken, last = {}, 0, 0, ''
local start = '(' .. ARGV[1]
local count = 512
while true do
  local want = math.min(count, most - taken)
  local page = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', want)
  for i = 1, #page do
    local fields = page[i][2]
    if fields[2] == 'close' then
      return {meta, last, payloads, 'ended'}
    end
    if fields[3] ~= 'b' then
      return {meta, last, payloads, 'text'}
    end
    local payload = fields[4]
    if taken > 0 and size + #payload > limit then
      return {meta, last, payloads, 'full'}
    end
    taken = taken + 1
    payloads[taken] = payload
    size = size + #payload
    last = page[i][1]
  end
  if #page < want then return {meta, last, payloads, 'tail'} end
  if taken >= most then return {meta, last, payloads, 'more'} end
  start = '(' .. last
  count = math.min(count * 2, 4096)
end
