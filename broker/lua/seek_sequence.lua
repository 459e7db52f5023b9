-- seek_sequence: find where a read numbered by the OpenAI Responses sequence resumes, from a
-- sequence number, walking at most ARGV[5] entries of the turn's stream per call.
--
-- A Responses read numbers its events from the stored events alone: ARGV[2] opening events,
-- then each stored event, in stream order, expands to the number of Responses events that the
-- expansion table (ARGV[8] on) gives its type. The table is the one the dialect renders with
-- (broker/dialects/openai/events.py, EXPANSION), sent with every call: a name is an event type
-- ("delta") or an event type and attempt ("attempt:1", which wins over "attempt" for attempt 1);
-- a type the table does not name expands to nothing.
--
-- Counting from the stream's start costs a walk of everything before the resume point, so the
-- walk leaves checkpoints behind: every ARGV[3] entries, and where a walk stops at its bound, the
-- pair (entry id, the sequence number of what follows it) goes into a sorted set. They are facts
-- about an append-only prefix, so they never go stale; a later seek starts from the nearest one.
-- The set is a cache: it expires with the stream (or after ARGV[4] ms while the stream has no
-- expiry yet), and a seek without it walks from the start again.
--
-- The walk is bounded, so that one call never holds the server for a long stream: after ARGV[5]
-- entries it stops, answers where it stands with done = 0, and the caller calls again from
-- there (ARGV[6], ARGV[7]) until done = 1.
--
-- KEYS[1]  event stream    {c:<conversation>}:events:<turn_id>
-- KEYS[2]  checkpoints     {c:<conversation>}:events:<turn_id>:responses-seq (sorted set)
-- ARGV[1]  starting_after  the last sequence number the client has
-- ARGV[2]  first           the sequence number of the first stored event's first expansion
-- ARGV[3]  every           entries between two checkpoints
-- ARGV[4]  ttl_ms          the checkpoints' expiry while the stream has none
-- ARGV[5]  limit           the most entries this call walks
-- ARGV[6]  from_after      where an earlier call stopped: an entry id ("" for none)
-- ARGV[7]  from_base       the sequence number of what follows from_after
-- ARGV[8..] name, count    the expansion table, in pairs
--
-- Returns  {after, base, done}: the entry id to read after ("0-0" for the start), the sequence
--          number of the first expansion of the entry that follows it, and 1 when that is the
--          resume point (0: the walk stopped at its bound; call again from after and base)
-- Errors   none of its own.
local target = tonumber(ARGV[1])
local base = tonumber(ARGV[2])
local every = tonumber(ARGV[3])
local limit = tonumber(ARGV[5])
local after = '0-0'
if ARGV[6] ~= '' then
  after = ARGV[6]
  base = tonumber(ARGV[7])
end
local counts, qualified = {}, {}
for i = 8, #ARGV, 2 do
  counts[ARGV[i]] = tonumber(ARGV[i + 1])
  local kind = string.match(ARGV[i], '^([^:]+):')
  if kind then
    qualified[kind] = true
  end
end

local near = redis.call('ZREVRANGEBYSCORE', KEYS[2], target, '-inf', 'LIMIT', 0, 1, 'WITHSCORES')
if #near == 2 and (after == '0-0' or tonumber(near[2]) > base) then
  after = near[1]
  base = tonumber(near[2])
end
local start = after == '0-0' and '-' or '(' .. after
local walked, wrote = 0, false

local function reply(done)
  if wrote then
    local ttl = redis.call('PTTL', KEYS[1])
    redis.call('PEXPIRE', KEYS[2], ttl > 0 and ttl or tonumber(ARGV[4]))
  end
  return {after, base, done}
end

local function expansion(kind, data)
  if qualified[kind] then
    local ok, decoded = pcall(cjson.decode, data)
    local n = ok and type(decoded) == 'table' and tonumber(decoded['attempt']) or nil
    if n and counts[kind .. ':' .. n] then
      return counts[kind .. ':' .. n]
    end
  end
  return counts[kind] or 0
end

while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', math.min(1024, limit - walked))
  if #page == 0 then
    return reply(1)
  end
  for _, entry in ipairs(page) do
    local fields = entry[2]
    local kind, data = 'message', '{}'
    for i = 1, #fields, 2 do
      if fields[i] == 'e' then kind = fields[i + 1] elseif fields[i] == 'd' then data = fields[i + 1] end
    end
    local count = expansion(kind, data)
    if base + count - 1 > target then
      return reply(1)
    end
    base = base + count
    after = entry[1]
    walked = walked + 1
    if walked % every == 0 then
      redis.call('ZADD', KEYS[2], base, after)
      wrote = true
    end
  end
  if walked >= limit then
    redis.call('ZADD', KEYS[2], base, after)
    wrote = true
    return reply(0)
  end
  start = '(' .. page[#page][1]
end
