// The AI SDK's own transport and stream reader against a live broker (BROKER_URL).
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { test } from "node:test";

import { Chat } from "@ai-sdk/react";
import { DefaultChatTransport, readUIMessageStream } from "ai";

const BASE = process.env.BROKER_URL;
assert.ok(BASE, "BROKER_URL must name a running broker");
const API = `${BASE}/v1/ui/chat`;

const ids = () => randomUUID().replaceAll("-", "").slice(0, 16);

function user(text) {
  return { id: `m${ids()}`, role: "user", parts: [{ type: "text", text }] };
}

function transport(simulate, api = API) {
  return new DefaultChatTransport({ api, body: { params: { simulate } } });
}

/** Reads a chunk stream with the package's reader: the last message, and every chunk seen. */
async function assemble(stream, { message, stopWhen } = {}) {
  const chunks = [];
  const seen = stream.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        chunks.push(chunk);
        controller.enqueue(chunk);
      },
    }),
  );
  let last;
  try {
    for await (const snapshot of readUIMessageStream({ message, stream: seen })) {
      last = snapshot;
      if (stopWhen?.(snapshot)) break;
    }
  } catch (error) {
    if (error.name !== "AbortError") throw error;
  }
  return { message: last, chunks, types: chunks.map((c) => c.type) };
}

function textOf(message) {
  return message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
}

async function turn(turnId) {
  const response = await fetch(`${BASE}/v1/turns/${turnId}`);
  assert.equal(response.status, 200);
  return response.json();
}

async function waitFor(check, what, timeoutMs = 15_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 25));
  }
}

async function send(t, chatId, messages, extra = {}) {
  return t.sendMessages({ chatId, messages, trigger: "submit-message", messageId: undefined,
                          abortSignal: undefined, ...extra });
}

test("sendMessages streams the turn's answer as UI message chunks", async () => {
  const chatId = `c${ids()}`;
  const question = user("Tell me about resumable streams.");
  const t = transport({ seed: 7, tokens: 30, tokens_per_s: 0 });
  const { message, types, chunks } = await assemble(await send(t, chatId, [question]));
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.equal(message.role, "assistant");
  assert.equal(textOf(message), state.canonical.text);
  assert.ok(state.canonical.text.length > 0);
  const texts = message.parts.filter((p) => p.type === "text");
  assert.equal(texts.length, 1);
  assert.equal(texts[0].state, "done");
  // The documented order: start, facts, step, one text part, the end's facts, finish.
  const deltas = types.filter((type) => type === "text-delta").length;
  assert.ok(deltas >= 1);
  assert.deepEqual(types, [
    "start", "data-broker", "start-step", "text-start",
    ...Array(deltas).fill("text-delta"), "text-end", "finish-step", "data-broker", "finish",
  ]);
  const textIds = new Set(chunks.filter((c) => c.type.startsWith("text-")).map((c) => c.id));
  assert.equal(textIds.size, 1);
  const facts = message.parts.filter((p) => p.type === "data-broker");
  assert.equal(facts.length, 1, "the broker's facts are one part, updated in place");
  assert.equal(facts[0].data.turnId, question.id);
  assert.equal(facts[0].data.streamId, state.stream_id);
  assert.equal(facts[0].data.status, "complete");
  assert.equal(facts[0].data.attempt, 1);
  assert.match(facts[0].data.offset, /^\d{16}-\d{10}$/);
});

test("a cut stream resumes by reconnectToStream with the same message, once", async () => {
  const simulate = { seed: 11, tokens: 60, tokens_per_s: 80 };
  const prompt = "Explain offsets.";
  // The uninterrupted run, in a chat of its own: the simulated text depends on seed and prompt.
  const whole = await assemble(await send(transport({ ...simulate, tokens_per_s: 0 }),
                                          `c${ids()}`, [user(prompt)]));
  const chatId = `c${ids()}`;
  const question = user(prompt);
  const t = transport(simulate);
  const abort = new AbortController();
  const cut = await assemble(await send(t, chatId, [question], { abortSignal: abort.signal }), {
    stopWhen: (m) => textOf(m).length > 0 && (abort.abort(), true),
  });
  assert.ok(textOf(cut.message).length > 0);
  assert.notEqual((await turn(question.id)).status, "complete", "the cut came mid-answer");
  const resumed = await assemble(await t.reconnectToStream({ chatId }));
  assert.equal(resumed.types[0], "start", "a resume replays from start");
  assert.equal(resumed.types.at(-1), "finish");
  const conversation = [question, resumed.message];
  assert.equal(conversation.filter((m) => m.role === "assistant").length, 1);
  assert.equal(resumed.message.id, cut.message.id, "the same message, rebuilt");
  assert.equal(resumed.message.parts.filter((p) => p.type === "text").length, 1);
  assert.equal(textOf(resumed.message), textOf(whole.message));
  assert.equal(textOf(resumed.message), (await turn(question.id)).canonical.text);
  const ats = resumed.types.filter((type) => type === "text-start").length;
  assert.equal(ats, 1, "no doubled text part");
});

test("reconnectToStream after the turn finished answers null at once", async () => {
  const chatId = `c${ids()}`;
  const t = transport({ seed: 3, tokens: 5, tokens_per_s: 0 });
  await assemble(await send(t, chatId, [user("hi")]));
  const started = Date.now();
  assert.equal(await t.reconnectToStream({ chatId }), null);
  assert.ok(Date.now() - started < 2_000);
  assert.equal(await t.reconnectToStream({ chatId: `c${ids()}` }), null, "an unknown chat");
});

test("the same user message from two transports is one generation", async () => {
  const chatId = `c${ids()}`;
  const question = user("Pay the invoice once.");
  const simulate = { seed: 5, tokens: 20, tokens_per_s: 100 };
  const [a, b] = await Promise.all([
    send(transport(simulate), chatId, [question]).then((s) => assemble(s)),
    send(transport(simulate), chatId, [question]).then((s) => assemble(s)),
  ]);
  const state = await turn(question.id);
  assert.equal(state.attempts.length, 1);
  assert.equal(state.attempts[0].strategy, "initial");
  assert.equal(textOf(a.message), state.canonical.text);
  assert.equal(textOf(b.message), state.canonical.text);
});

test("stop ends the stream with abort, keeps the partial and cancels the turn", async () => {
  const chatId = `c${ids()}`;
  const question = user("A long answer, please.");
  const t = transport({ seed: 9, tokens: 400, tokens_per_s: 40 });
  let stopped;
  const result = await assemble(await send(t, chatId, [question]), {
    stopWhen: (m) => {
      if (!stopped && textOf(m).length > 0) {
        stopped = fetch(`${API}/${chatId}/stop`, { method: "POST" });
      }
      return false;
    },
  });
  assert.equal((await stopped).status, 200);
  assert.equal(result.types.at(-1), "abort");
  assert.ok(!result.types.includes("finish"));
  const state = await turn(question.id);
  assert.equal(state.status, "cancelled");
  assert.equal(textOf(result.message), state.canonical?.text ?? "");
  const facts = result.message.parts.find((p) => p.type === "data-broker");
  assert.equal(facts.data.status, "cancelled");
});

test("regenerate-message starts a regenerate attempt and keeps one canonical attempt", async () => {
  const chatId = `c${ids()}`;
  const question = user("Say it differently.");
  const t = transport({ seed: 21, tokens: 15, tokens_per_s: 0 });
  const first = await assemble(await send(t, chatId, [question]));
  const again = await assemble(await t.sendMessages({
    chatId, messages: [question], trigger: "regenerate-message",
    messageId: first.message.id, abortSignal: undefined,
  }));
  assert.equal(again.types[0], "start");
  assert.equal(again.types.filter((type) => type === "start-step").length, 1);
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.deepEqual(state.attempts.map((a) => a.strategy), ["initial", "regenerate"]);
  assert.equal(state.attempts.filter((a) => a.canonical).length, 1);
  assert.equal(state.canonical.attempt, 2);
  assert.equal(textOf(again.message), state.canonical.text);
  const facts = again.message.parts.find((p) => p.type === "data-broker");
  assert.equal(facts.data.attempt, 2);
  // Sending the message again attaches: its replay shows the answer the turn has now, alone.
  const replay = await assemble(await send(t, chatId, [question]));
  assert.equal(replay.types.filter((type) => type === "text-start").length, 1);
  assert.equal(textOf(replay.message), state.canonical.text);
  assert.equal((await turn(question.id)).attempts.length, 2, "no third attempt");
});

test("an interrupted turn ends with an error chunk; continue appends to the message", async () => {
  const chatId = `c${ids()}`;
  const question = user("Keep going after a break.");
  const t = transport({ seed: 13, tokens: 30, tokens_per_s: 0, fail_after_deltas: 8 });
  const errors = [];
  const cut = await assemble(await send(t, chatId, [question]));
  assert.deepEqual(cut.types.slice(-4), ["finish-step", "data-broker", "error", "finish"]);
  const error = cut.chunks.find((c) => c.type === "error");
  assert.equal(error.errorText, "turn_interrupted");
  assert.equal(cut.chunks.at(-1).finishReason, "interrupted");
  const facts = cut.message.parts.find((p) => p.type === "data-broker");
  assert.equal(facts.data.status, "interrupted");
  assert.equal(facts.data.partial, true);
  const partial = textOf(cut.message);
  assert.ok(partial.length > 0);
  assert.equal((await turn(question.id)).status, "interrupted");

  // The continue endpoint, through the same package: a transport aimed at it.
  const onward = new DefaultChatTransport({ api: `${API}/${chatId}/continue` });
  const continued = await assemble(await send(onward, chatId, [question, cut.message]),
                                   { message: cut.message });
  assert.equal(continued.types[0], "start");
  assert.equal(continued.chunks[0].messageId, cut.message.id, "the same message goes on");
  assert.equal(continued.types.at(-1), "finish");
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.deepEqual(state.attempts.map((a) => a.strategy), ["initial", "continue"]);
  const text = textOf(continued.message);
  assert.ok(text.startsWith(partial), "the partial stays in front");
  assert.ok(text.length > partial.length);
  assert.equal(text, state.canonical.text, "partial + continuation, no seam doubled");
  assert.equal(errors.length, 0);
  // A full replay of the turn rebuilds the same text.
  const replay = await assemble(await send(t, chatId, [question]));
  assert.equal(textOf(replay.message), state.canonical.text);
});

test("a ledger tool call shows as tool-input-available and tool-output-available", async () => {
  const chatId = `c${ids()}`;
  const question = user("What is the weather in Oslo?");
  const t = transport({ seed: 17, tokens: 20, tokens_per_s: 0,
                        tool_calls: [{ name: "get_weather", args: { city: "Oslo" }, after: 4 }] });
  const { message, types, chunks } = await assemble(await send(t, chatId, [question]));
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  const input = types.indexOf("tool-input-available");
  const output = types.indexOf("tool-output-available");
  assert.ok(input > 0 && output > input, types.join(","));
  assert.equal(types[input - 1], "text-end", "the text part closes before the call");
  assert.equal(chunks[input].toolName, "get_weather");
  assert.deepEqual(chunks[input].input, { city: "Oslo" });
  const [tool] = message.parts.filter((p) => p.type === "tool-get_weather");
  assert.equal(tool.state, "output-available");
  assert.deepEqual(tool.input, { city: "Oslo" });
  assert.deepEqual(tool.output, { sky: "clear", call: 1 });
  assert.equal(tool.toolCallId, chunks[input].toolCallId);
  assert.equal(textOf(message), state.canonical.text);
  assert.equal(types.at(-1), "finish");
  const ledger = await (await fetch(`${BASE}/v1/turns/${question.id}/tool-calls`)).json();
  assert.equal(ledger.tool_calls.length, 1);
});

test("without replay, a chat resumes after the offset its text part holds", async () => {
  const simulate = { seed: 29, tokens: 60, tokens_per_s: 80 };
  const prompt = "Resume from where I was.";
  const whole = await assemble(await send(transport({ ...simulate, tokens_per_s: 0 }),
                                          `c${ids()}`, [user(prompt)]));
  let dropped = false;
  let resumedFrom;
  // A network that drops mid-answer: the body fails the way a lost connection does.
  async function flaky(url, init) {
    const response = await fetch(url, init);
    if (init.method !== "POST") return response;
    const reader = response.body.getReader();
    let seen = 0;
    const body = new ReadableStream({
      async pull(controller) {
        const { done, value } = await reader.read();
        if (done) return controller.close();
        controller.enqueue(value);
        seen += value.length;
        if (seen > 1_500) {
          dropped = true;
          await reader.cancel();
          controller.error(new TypeError("network error"));
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  }
  const chat = new Chat({
    id: `c${ids()}`,
    transport: new DefaultChatTransport({
      api: API,
      fetch: flaky,
      body: { params: { simulate } },
      resumeStreamIsReplay: false,
      prepareReconnectToStreamRequest: ({ id }) => {
        const answer = chat.messages.findLast((m) => m.role === "assistant");
        resumedFrom = answer.parts.findLast((p) => p.type === "text").providerMetadata.broker.offset;
        return { api: `${API}/${id}/stream`, headers: { "Last-Event-ID": resumedFrom } };
      },
    }),
  });
  await chat.sendMessage({ text: prompt });
  assert.ok(dropped);
  assert.equal(chat.status, "error");
  const questionId = chat.messages[0].id;
  const partial = textOf(chat.messages[1]);
  assert.ok(partial.length > 0);
  assert.notEqual((await turn(questionId)).status, "complete", "the drop came mid-answer");
  await chat.resumeStream();
  assert.match(resumedFrom, /^\d{16}-\d{10}$/);
  assert.equal(chat.status, "ready");
  assert.deepEqual(chat.messages.map((m) => m.role), ["user", "assistant"]);
  const answer = chat.messages[1];
  assert.equal(answer.parts.filter((p) => p.type === "text").length, 1, "no doubled text part");
  assert.ok(textOf(answer).startsWith(partial));
  assert.equal(textOf(answer), textOf(whole.message), "no gap, no repeat");
  assert.equal((await turn(questionId)).attempts.length, 1);
});

test("the image files of a user's message reach the model; other files are refused", async () => {
  const png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    + "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
  const chat = new Chat({ id: `c${ids()}`, transport: transport({ seed: 5, tokens: 6, tokens_per_s: 0 }) });
  await chat.sendMessage({
    text: "What is in these pictures?",
    files: [
      { type: "file", mediaType: "image/png", url: png },
      { type: "file", mediaType: "image/jpeg", url: "https://images.example.com/cat.jpg" },
    ],
  });
  await waitFor(() => chat.status === "ready" && chat.messages.length === 2, "the answer");
  const [question, answer] = chat.messages;
  assert.ok(textOf(answer).startsWith("(shown 2 images: image/png, images.example.com) "),
            textOf(answer));
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.equal(textOf(answer), state.canonical.text);
  // A PDF is not an image: the request is refused, naming the part, and no turn is made.
  const pdf = { id: `m${ids()}`, role: "user", parts: [
    { type: "text", text: "Summarise this" },
    { type: "file", mediaType: "application/pdf", url: "https://files.example.com/a.pdf" },
  ] };
  const refused = await fetch(API, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ id: `c${ids()}`, messages: [pdf], trigger: "submit-message" }),
  });
  assert.equal(refused.status, 400);
  const body = await refused.json();
  assert.equal(body.error.code, "bad_messages");
  assert.match(body.error.message, /messages\[0\]\.parts\[1\].*application\/pdf/);
  assert.equal((await fetch(`${BASE}/v1/turns/${pdf.id}`)).status, 404);
});
