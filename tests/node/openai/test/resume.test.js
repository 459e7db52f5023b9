// The official openai Node SDK reads a broker response, is cut off, and resumes with
// starting_after: the text is byte-identical and no sequence number repeats or goes back.
// BROKER_URL names a live broker (the pytest test tests/test_openai_node.py starts one).
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";

const base = process.env.BROKER_URL;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });

function deltas(events) {
  return events
    .filter((e) => e.type === "response.output_text.delta")
    .map((e) => e.delta)
    .join("");
}

async function canonicalText(id) {
  const state = await (await fetch(`${base}/v1/turns/${id}`)).json();
  assert.equal(state.status, "complete");
  return state.canonical.text;
}

test("a response cut anywhere resumes with starting_after, byte for byte", async () => {
  for (const cut of [1, 2, 3, 7, 23, 41]) {
    const stream = await client.responses.create({
      model: "simulated",
      input: `node reader cut after ${cut}`,
      stream: true,
      background: true,
      broker: { params: { simulate: { seed: cut, tokens: 40, tokens_per_s: 400 } } },
    });
    const first = [];
    for await (const event of stream) {
      first.push(event);
      if (first.length === cut) break;
    }
    const id = first[0].response.id;
    const resumed = await client.responses.retrieve(id, {
      stream: true,
      starting_after: first.at(-1).sequence_number,
    });
    const rest = [];
    for await (const event of resumed) rest.push(event);
    const numbers = [...first, ...rest].map((e) => e.sequence_number);
    assert.deepEqual(numbers, [...numbers.keys()]);
    assert.equal(rest.at(-1).type, "response.completed");
    assert.equal(deltas(first) + deltas(rest), await canonicalText(id));

    const replay = [];
    for await (const event of await client.responses.retrieve(id, { stream: true })) {
      replay.push(event);
    }
    assert.deepEqual(replay, [...first, ...rest]);
  }
});

test("cancel stops a running response and answers status cancelled", async () => {
  const created = await client.responses.create({
    model: "simulated",
    input: "slow",
    background: true,
    broker: { params: { simulate: { tokens: 400, tokens_per_s: 20 } } },
  });
  const cancelled = await client.responses.cancel(created.id);
  assert.equal(cancelled.status, "cancelled");
  assert.equal((await client.responses.cancel(created.id)).status, "cancelled");
});

test("a cut chat completion reattaches with its Idempotency-Key and Last-Event-ID", async () => {
  const body = {
    model: "simulated",
    messages: [{ role: "user", content: "node chat" }],
    stream: true,
    broker: { params: { simulate: { seed: 3, tokens: 30, tokens_per_s: 300 } } },
  };
  const key = { "Idempotency-Key": "node-chat-1" };
  const first = [];
  for await (const chunk of await client.chat.completions.create(body, { headers: key })) {
    first.push(chunk);
    if (first.length === 9) break;
  }
  const offset = first.at(-1).broker_offset;
  const rest = [];
  const again = await client.chat.completions.create(body, {
    headers: { ...key, "Last-Event-ID": offset },
  });
  for await (const chunk of again) rest.push(chunk);
  const text = [...first, ...rest].map((c) => c.choices[0]?.delta?.content ?? "").join("");
  assert.equal(text, await canonicalText("node-chat-1"));
  assert.equal(rest.at(-1).choices[0].finish_reason, "stop");
});
