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
-- This script walks the stream from its start server-side (only two values come back), so a
-- resume costs one round trip and no lookup per event. Keep the table in step with
-- broker/dialects/openai/events.py.
--
-- KEYS[1]  event stream   {c:<conversation>}:events:<turn_id>
-- ARGV[1]  starting_after the last sequence number the client has
-- ARGV[2]  first          the sequence number of the first stored event's first expansion
--
-- Returns  {after, base}: the entry id to read after ("0-0" for the start), and the sequence
--          number of the first expansion of the entry that follows it
local target = tonumber(ARGV[1])
local base = tonumber(ARGV[2])
local after = '0-0'
local start = '-'
while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1024)
  if #page == 0 then
    return {after, base}
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
      return {after, base}
    end
    base = base + count
    after = entry[1]
  end
  start = '(' .. page[#page][1]
end
