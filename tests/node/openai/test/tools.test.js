// The official openai Node SDK runs an agent loop with two function tools through the broker,
// whose simulated provider scripts the calls: cut mid-call and resumed, the calls come once each
// with the ids the broker lists; the outputs sent back, the next response answers.
// BROKER_URL names a live broker (the pytest test tests/test_openai_node.py starts one).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";

const base = process.env.BROKER_URL;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });

const tools = [
  {
    type: "function",
    name: "get_weather",
    parameters: { type: "object", properties: { city: { type: "string" } } },
    strict: false,
  },
  { type: "function", name: "get_time", parameters: { type: "object" }, strict: false },
];
const script = [
  { name: "get_weather", args: { city: "Oslo" }, after: 2 },
  { name: "get_time", args: { zone: "Europe/Oslo" }, after: 2 },
];
const results = { get_weather: '{"sky": "clear"}', get_time: "14:05" };

function simulate(knobs = {}) {
  return { params: { simulate: { tokens: 6, tokens_per_s: 0, ...knobs } } };
}

async function pending(id) {
  return (await (await fetch(`${base}/v1/turns/${id}`)).json()).tool_calls;
}

test("a responses agent loop is cut mid-call, resumed, and runs to its answer", async () => {
  const stream = await client.responses.create({
    model: "simulated",
    input: "Weather and time in Oslo?",
    tools,
    stream: true,
    broker: simulate({ tool_calls: script }),
  });
  const first = [];
  for await (const event of stream) {
    first.push(event);
    if (event.type === "response.function_call_arguments.delta") break; // mid-call
  }
  const id = first[0].response.id;
  const rest = [];
  const resumed = await client.responses.retrieve(id, {
    stream: true,
    starting_after: first.at(-1).sequence_number,
  });
  for await (const event of resumed) rest.push(event);
  const events = [...first, ...rest];
  assert.deepEqual(
    events.map((e) => e.sequence_number),
    [...events.keys()],
  );
  const done = rest.at(-1);
  assert.equal(done.type, "response.completed");
  const calls = done.response.output.filter((item) => item.type === "function_call");
  const added = events
    .filter((e) => e.type === "response.output_item.added" && e.item.type === "function_call")
    .map((e) => e.item.call_id);
  const listed = (await pending(id)).map((call) => call.call_id);
  assert.deepEqual(added, listed);
  assert.deepEqual(
    calls.map((call) => call.call_id),
    listed,
  );
  const answer = await client.responses.create({
    model: "simulated",
    previous_response_id: id,
    input: calls.map((call) => ({
      type: "function_call_output",
      call_id: call.call_id,
      output: results[call.name],
    })),
    tools,
    broker: simulate(),
  });
  assert.equal(answer.status, "completed");
  assert.match(answer.output_text, /^\(2 tool results/);
});

test("a chat agent loop is cut mid-call, reattached, and runs to its answer", async () => {
  const body = {
    model: "simulated",
    messages: [{ role: "user", content: "Weather and time in Oslo?" }],
    tools: tools.map(({ type, ...fn }) => ({ type, function: fn })),
    stream: true,
    broker: simulate({ tool_calls: script }),
  };
  const key = { "Idempotency-Key": "node-chat-tools" };
  const first = [];
  for await (const chunk of await client.chat.completions.create(body, { headers: key })) {
    first.push(chunk);
    if (chunk.choices[0]?.delta?.tool_calls && first.length > 3) break; // mid-call
  }
  const rest = [];
  const again = await client.chat.completions.create(body, {
    headers: { ...key, "Last-Event-ID": first.at(-1).broker_offset },
  });
  for await (const chunk of again) rest.push(chunk);
  assert.equal(rest.at(-1).choices[0].finish_reason, "tool_calls");
  const calls = [];
  for (const chunk of [...first, ...rest]) {
    for (const call of chunk.choices[0]?.delta?.tool_calls ?? []) {
      if (call.id) {
        assert.equal(calls[call.index], undefined, "a call started twice");
        calls[call.index] = { id: call.id, name: call.function.name, arguments: "" };
      }
      calls[call.index].arguments += call.function.arguments ?? "";
    }
  }
  const listed = await pending("node-chat-tools");
  assert.deepEqual(
    calls.map((c) => [c.id, c.name, JSON.parse(c.arguments)]),
    listed.map((c) => [c.call_id, c.name, JSON.parse(c.arguments)]),
  );
  const answer = await client.chat.completions.create({
    model: "simulated",
    messages: [
      ...body.messages,
      {
        role: "assistant",
        content: null,
        tool_calls: calls.map((c) => ({
          id: c.id,
          type: "function",
          function: { name: c.name, arguments: c.arguments },
        })),
      },
      ...calls.map((c) => ({ role: "tool", tool_call_id: c.id, content: results[c.name] })),
    ],
    tools: body.tools,
    broker: simulate(),
  });
  assert.equal(answer.choices[0].finish_reason, "stop");
  assert.match(answer.choices[0].message.content, /^\(2 tool results/);
});
