-- seek_sequence: find where a Responses read resumes, from a sequence number, in one step.
--
-- The OpenAI Responses dialect numbers its events from the stored events alone: two opening
-- events (response.created, response.in_progress), then each stored event in order expands to a
-- fixed number of Responses events by its type:
--   attempt  2 for attempt 1 (output_item.added, content_part.added),
--            3 for a later attempt (response.in_progress first)
--   delta    1 (response.output_text.delta)
--   end      4 (output_text.done, content_part.done, output_item.done, the terminal event)
--   others   0 (usage, error, tool_call, tool_result: folded into the terminal response)
-- Keep the table in step with broker/dialects/openai/events.py.
--
-- Counting from the stream's start costs a walk of everything before the resume point, so the
-- walk leaves checkpoints behind: every ARGV[3] entries, the pair (entry id, the sequence number
-- of what follows it) goes into a sorted set. They are facts about an append-only prefix, so they
-- never go stale; a later seek starts from the nearest one and walks at most ARGV[3] entries.
-- The set is a cache: it expires with the stream (or after ARGV[4] ms while the stream has no
-- expiry yet), and a seek without it walks from the start again.
--
-- KEYS[1]  event stream   {c:<conversation>}:events:<turn_id>
-- KEYS[2]  checkpoints    {c:<conversation>}:events:<turn_id>:responses-seq (sorted set)
-- ARGV[1]  starting_after the last sequence number the client has
-- ARGV[2]  first          the sequence number of the first stored event's first expansion
-- ARGV[3]  every          entries between two checkpoints
-- ARGV[4]  ttl_ms         the checkpoints' expiry while the stream has none
--
-- Returns  {after, base}: the entry id to read after ("0-0" for the start), and the sequence
--          number of the first expansion of the entry that follows it
local target = tonumber(ARGV[1])
local base = tonumber(ARGV[2])
local every = tonumber(ARGV[3])
local after = '0-0'
local near = redis.call('ZREVRANGEBYSCORE', KEYS[2], target, '-inf', 'LIMIT', 0, 1, 'WITHSCORES')
if #near == 2 then
  after = near[1]
  base = tonumber(near[2])
end
local start = after == '0-0' and '-' or '(' .. after
local walked, wrote = 0, false

local function done()
  if wrote then
    local ttl = redis.call('PTTL', KEYS[1])
    redis.call('PEXPIRE', KEYS[2], ttl > 0 and ttl or tonumber(ARGV[4]))
  end
  return {after, base}
end

while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1024)
  if #page == 0 then
    return done()
  end
  for _, entry in ipairs(page) do
    local fields = entry[2]
    local kind, data = 'message', '{}'
    for i = 1, #fields, 2 do
      if fields[i] == 'e' then kind = fields[i + 1] elseif fields[i] == 'd' then data = fields[i + 1] end
    end
    local count = 0
    if kind == 'delta' then
      count = 1
    elseif kind == 'end' then
      count = 4
    elseif kind == 'attempt' then
      local ok, decoded = pcall(cjson.decode, data)
      if ok and type(decoded) == 'table' and tonumber(decoded['attempt']) == 1 then
        count = 2
      else
        count = 3
      end
    end
    if base + count - 1 > target then
      return done()
    end
    base = base + count
    after = entry[1]
    walked = walked + 1
    if walked % every == 0 then
      redis.call('ZADD', KEYS[2], base, after)
      wrote = true
    end
  end
  start = '(' .. page[#page][1]
end
