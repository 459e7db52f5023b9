// The official openai Node SDK asks the broker for structured output: a JSON-schema extraction
// through Responses (`text.format`) and Chat Completions (`response_format`), with the SDK's own
// `parse` helpers reading the answer, streamed and whole. The simulated provider streams the JSON
// answer in pieces (`simulate.json`); the broker validates it against the schema before it
// becomes canonical, and a result that does not validate is a failed response, never parsed.
// BROKER_URL names a live broker (the pytest test tests/test_openai_node.py starts one).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";

const base = process.env.BROKER_URL;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });

const schema = {
  type: "object",
  properties: {
    city: { type: "string" },
    tunnels: { type: "array", items: { type: "integer" } },
  },
  required: ["city", "tunnels"],
  additionalProperties: false,
};
const good = { city: "Bern", tunnels: [3, 4] };
const format = { type: "json_schema", name: "tunnels", schema, strict: true };

function answer(value) {
  return { params: { simulate: { json: value, tokens: 5, tokens_per_s: 0 } } };
}

test("responses.parse extracts the JSON the schema asks for, and echoes the format", async () => {
  const parsed = await client.responses.parse({
    model: "simulated",
    input: "Tunnels of Bern?",
    text: { format },
    broker: answer(good),
  });
  assert.equal(parsed.status, "completed");
  assert.deepEqual(parsed.output_parsed, good);
  assert.deepEqual(parsed.text.format, format);
});

test("a streamed extraction arrives in pieces and completes with the whole JSON", async () => {
  const stream = await client.responses.create({
    model: "simulated",
    input: "Tunnels of Bern?",
    text: { format },
    stream: true,
    broker: answer(good),
  });
  const deltas = [];
  let done;
  for await (const event of stream) {
    if (event.type === "response.output_text.delta") deltas.push(event.delta);
    if (event.type === "response.completed") done = event.response;
  }
  assert.ok(deltas.length > 1, `one delta only: ${JSON.stringify(deltas)}`);
  assert.deepEqual(JSON.parse(deltas.join("")), good);
  const text = done.output
    .filter((item) => item.type === "message")
    .flatMap((item) => item.content.map((part) => part.text))
    .join("");
  assert.deepEqual(JSON.parse(text), good);
});

test("chat.completions.parse reads the response_format's JSON", async () => {
  const completion = await client.chat.completions.parse({
    model: "simulated",
    messages: [{ role: "user", content: "Tunnels of Bern?" }],
    response_format: { type: "json_schema", json_schema: { name: "tunnels", schema, strict: true } },
    broker: answer(good),
  });
  const message = completion.choices[0].message;
  assert.equal(completion.choices[0].finish_reason, "stop");
  assert.deepEqual(message.parsed, good);
});

test("an answer that breaks the schema fails the response and is never parsed", async () => {
  const response = await client.responses.create({
    model: "simulated",
    input: "Tunnels of Bern?",
    text: { format },
    broker: answer({ city: "Bern", tunnels: [3, "four"] }),
  });
  assert.equal(response.status, "failed");
  assert.match(response.error.message, /^invalid_output: the answer does not match the schema/);
  assert.match(response.error.message, /\$\.tunnels\[1\]/);
});
