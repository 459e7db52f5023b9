// Client tools through the AI SDK door, with the package's own Chat (what useChat runs): the
// client runs the calls in onToolCall, adds their outputs, and sends the chat again by itself.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { test } from "node:test";

import { Chat } from "@ai-sdk/react";
import {
  DefaultChatTransport, lastAssistantMessageIsCompleteWithToolCalls, readUIMessageStream,
} from "ai";

const BASE = process.env.BROKER_URL;
assert.ok(BASE, "BROKER_URL must name a running broker");
const API = `${BASE}/v1/ui/chat`;

const ids = () => randomUUID().replaceAll("-", "").slice(0, 16);

// The tools the app declares: JSON Schema input, sent in the body of every request.
const TOOLS = {
  get_weather: {
    description: "The weather in a city",
    inputSchema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
  get_time: {
    description: "The local time in a city",
    inputSchema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};
// The simulated model calls both tools in one message, four words in; asked again with the
// outputs, it answers (and says how many results it saw).
const CALLS = [
  { name: "get_weather", args: { city: "Oslo" }, after: 4 },
  { name: "get_time", args: { city: "Oslo" }, after: 4 },
];

function textOf(message) {
  return message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
}

function toolParts(message) {
  return message.parts.filter((p) => p.type.startsWith("tool-"));
}

async function turn(turnId) {
  const response = await fetch(`${BASE}/v1/turns/${encodeURIComponent(turnId)}`);
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

/** A chat whose tools run here: each call id runs once (a call seen again gets its output). */
function toolChat({ fetch: fetchImpl, simulate = {}, ask = {}, answer = {}, transport = {} } = {}) {
  const ran = new Map(); // call id -> output
  const seen = [];
  const chat = new Chat({
    id: `c${ids()}`,
    transport: new DefaultChatTransport({
      api: API,
      fetch: fetchImpl,
      body: { tools: TOOLS },
      // The simulated model is scripted per request: calls for the question, prose after.
      prepareSendMessagesRequest: ({ id, messages, body, trigger, messageId }) => {
        const asking = messages.at(-1).role === "user";
        const script = asking ? { tool_calls: CALLS, tokens: 12, ...ask } : { tokens: 10, ...answer };
        return {
          body: { ...body, id, messages, trigger, messageId,
                  params: { simulate: { seed: 3, tokens_per_s: 0, ...simulate, ...script } } },
        };
      },
      ...transport,
    }),
    onToolCall: ({ toolCall }) => {
      seen.push(toolCall.toolCallId);
      if (!ran.has(toolCall.toolCallId)) {
        const { city } = toolCall.input;
        ran.set(toolCall.toolCallId, toolCall.toolName === "get_weather"
          ? { city, sky: "clear" } : { city, time: "12:00" });
      }
      // Not awaited (the package's advice): the output joins the message as it is added.
      chat.addToolOutput({ tool: toolCall.toolName, toolCallId: toolCall.toolCallId,
                           output: ran.get(toolCall.toolCallId) });
    },
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls,
  });
  return { chat, ran, seen };
}

const answered = (chat) => chat.status === "ready" && chat.messages.length === 2
  && textOf(chat.messages[1]).includes("tool results");

test("a chat with two client tools runs to its answer", async () => {
  const { chat, ran, seen } = toolChat();
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  await waitFor(() => answered(chat), "the answer after the tools ran");
  assert.deepEqual(chat.messages.map((m) => m.role), ["user", "assistant"]);
  const [question, answer] = chat.messages;
  const tools = toolParts(answer);
  assert.deepEqual(tools.map((p) => p.type), ["tool-get_weather", "tool-get_time"]);
  assert.deepEqual(tools.map((p) => p.state), ["output-available", "output-available"]);
  assert.deepEqual(tools.map((p) => p.input), [{ city: "Oslo" }, { city: "Oslo" }]);
  assert.deepEqual(seen, tools.map((p) => p.toolCallId), "each call handed over once");
  assert.equal(ran.size, 2);
  for (const id of seen) assert.match(id, /^call_[0-9a-f]{24}$/);
  assert.ok(!tools.some((p) => p.providerExecuted), "the client's calls, not the broker's");
  // The first turn ended requires_action with the calls the client ran, under the same ids.
  const first = await turn(question.id);
  assert.equal(first.status, "requires_action");
  assert.deepEqual(first.tool_calls.map((c) => c.call_id), seen);
  // The outputs went in a follow-up turn, whose answer went on in the same message.
  const facts = answer.parts.find((p) => p.type === "data-broker");
  assert.ok(facts.data.turnId.startsWith(`${answer.id}.tools-`), facts.data.turnId);
  assert.equal(answer.id, `${question.id}-reply`);
  const follow = await turn(facts.data.turnId);
  assert.equal(follow.status, "complete");
  const results = JSON.stringify(ran.get(seen[0])).length + JSON.stringify(ran.get(seen[1])).length;
  assert.ok(textOf(answer).includes(`(2 tool results, ${results} characters)`), textOf(answer));
  assert.ok(textOf(answer).endsWith(follow.canonical.text));
  assert.equal(answer.parts.filter((p) => p.type === "step-start").length, 2);
});

test("a reader cut while a call's arguments stream resumes and gets the call once", async () => {
  let cutAt;
  // A network that drops right after the first piece of a call's arguments arrived: the
  // body is passed on frame by frame, and fails the way a lost connection does.
  async function flaky(url, init) {
    const response = await fetch(url, init);
    if (init.method !== "POST" || cutAt !== undefined) return response;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const encoder = new TextEncoder();
    let buffered = "";
    const body = new ReadableStream({
      async pull(controller) {
        for (;;) {
          const end = buffered.indexOf("\n\n");
          if (end >= 0) {
            const frame = buffered.slice(0, end + 2);
            buffered = buffered.slice(end + 2);
            controller.enqueue(encoder.encode(frame));
            if (frame.includes('"tool-input-delta"')) {
              cutAt = /^id: (.+)$/m.exec(frame)?.[1];
              await reader.cancel();
              controller.error(new TypeError("network error"));
            }
            return;
          }
          const { done, value } = await reader.read();
          if (done) return controller.close();
          buffered += decoder.decode(value, { stream: true });
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  }
  const { chat, seen } = toolChat({
    fetch: flaky,
    transport: {
      resumeStreamIsReplay: false,
      prepareReconnectToStreamRequest: ({ id }) => ({
        api: `${API}/${id}/stream`, headers: { "Last-Event-ID": cutAt },
      }),
    },
  });
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  assert.equal(chat.status, "error", "the connection dropped");
  assert.match(cutAt, /^\d{16}-\d{10}$/, "the cut came after a frame with an id");
  const partial = toolParts(chat.messages[1]);
  assert.deepEqual(partial.map((p) => p.state), ["input-streaming"], "cut mid-arguments");
  assert.deepEqual(seen, [], "nothing handed over yet");
  await chat.resumeStream();
  await waitFor(() => answered(chat), "the answer after the resume");
  const tools = toolParts(chat.messages[1]);
  assert.deepEqual(tools.map((p) => p.type), ["tool-get_weather", "tool-get_time"]);
  assert.deepEqual(tools.map((p) => p.input), [{ city: "Oslo" }, { city: "Oslo" }]);
  assert.equal(tools[0].toolCallId, partial[0].toolCallId, "the same call, completed");
  assert.deepEqual(seen, tools.map((p) => p.toolCallId), "each call handed over once");
  const question = chat.messages[0];
  assert.deepEqual((await turn(question.id)).tool_calls.map((c) => c.call_id), seen);
});

test("a resume that replays the answer to the outputs rebuilds the whole message", async () => {
  let dropped = false;
  // A network that drops the request with the outputs once its answer began to stream.
  async function flaky(url, init) {
    const response = await fetch(url, init);
    if (init.method !== "POST" || dropped || JSON.parse(init.body).messages.length < 2) {
      return response;
    }
    const reader = response.body.getReader();
    const body = new ReadableStream({
      async pull(controller) {
        const { done, value } = await reader.read();
        if (done) return controller.close();
        controller.enqueue(value);
        if (new TextDecoder().decode(value).includes('"text-delta"')) {
          dropped = true;
          await reader.cancel();
          controller.error(new TypeError("network error"));
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  }
  // The answer to the outputs is slow enough to be running when the chat resumes.
  const { chat, seen } = toolChat({ fetch: flaky, answer: { tokens: 40, tokens_per_s: 20 } });
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  await waitFor(() => dropped && chat.status === "error", "the drop mid-answer");
  const followUp = chat.messages[1].parts.find((p) => p.type === "data-broker").data.turnId;
  assert.notEqual((await turn(followUp)).status, "complete", "the drop came mid-answer");
  await chat.resumeStream(); // the transport's default: a full replay from `start`
  await waitFor(() => chat.status === "ready", "the resumed answer");
  assert.deepEqual(chat.messages.map((m) => m.role), ["user", "assistant"]);
  const answer = chat.messages[1];
  const tools = toolParts(answer);
  assert.deepEqual(tools.map((p) => p.type), ["tool-get_weather", "tool-get_time"]);
  assert.deepEqual(tools.map((p) => p.state), ["output-available", "output-available"]);
  assert.deepEqual(tools.map((p) => p.input), [{ city: "Oslo" }, { city: "Oslo" }]);
  assert.deepEqual(tools.map((p) => p.output), [{ city: "Oslo", sky: "clear" },
                                                { city: "Oslo", time: "12:00" }]);
  assert.deepEqual(seen, tools.map((p) => p.toolCallId), "the replay hands no call over again");
  assert.equal(answer.parts.filter((p) => p.type === "step-start").length, 2);
  assert.equal(answer.id, `${chat.messages[0].id}-reply`);
  // The text of both steps, each once: the calls' turn's, then the answer's.
  const [first, second] = [await turn(chat.messages[0].id), await turn(followUp)];
  assert.equal(second.status, "complete");
  assert.ok(second.canonical.text.startsWith("(2 tool results"));
  assert.equal(textOf(answer), first.canonical.text + second.canonical.text);
  // The chat goes on from the rebuilt message: its next question is a turn like any other.
  await chat.sendMessage({ text: "Thanks!" });
  await waitFor(() => chat.status === "ready" && chat.messages.length === 4, "the next answer");
  assert.ok(textOf(chat.messages[3]).length > 0);
});

test("a regenerate hands the same call ids, and the client runs nothing twice", async () => {
  const { chat, ran, seen } = toolChat();
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  await waitFor(() => answered(chat), "the first answer");
  const firstIds = toolParts(chat.messages[1]).map((p) => p.toolCallId);
  assert.equal(firstIds.length, 2);
  const turnOf = () => chat.messages[1].parts.find((p) => p.type === "data-broker").data.turnId;
  const firstAnswer = turnOf();
  await chat.regenerate();
  await waitFor(() => answered(chat), "the regenerated answer");
  const question = chat.messages[0];
  const state = await turn(question.id);
  assert.deepEqual(state.attempts.map((a) => a.strategy), ["initial", "regenerate"]);
  assert.equal(state.canonical.attempt, 2);
  const again = toolParts(chat.messages[1]);
  assert.deepEqual(again.map((p) => p.toolCallId), firstIds, "the same calls, the same ids");
  assert.deepEqual(again.map((p) => p.state), ["output-available", "output-available"]);
  assert.deepEqual(seen, [...firstIds, ...firstIds], "handed over again, under the same ids");
  assert.equal(ran.size, 2, "and run once each: the client deduplicates on the id");
  // The outputs of the regenerated answer's calls are a turn of their own: a new answer.
  assert.notEqual(turnOf(), firstAnswer);
  assert.equal((await turn(turnOf())).status, "complete");
  assert.equal((await turn(firstAnswer)).attempts.length, 1, "the first answer untouched");
});

test("a resume while a regenerate runs shows the regenerated answer and its calls", async () => {
  const slow = [{ ...CALLS[0], after: 20 }, { ...CALLS[1], after: 20 }];
  const { chat } = toolChat({ ask: { tool_calls: slow, tokens: 30, tokens_per_s: 20 } });
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  await waitFor(() => answered(chat), "the first answer");
  const question = chat.messages[0];
  const firstIds = toolParts(chat.messages[1]).map((p) => p.toolCallId);
  const regenerated = chat.regenerate();
  await waitFor(async () => {
    const state = await turn(question.id);
    return state.attempts.length === 2 && state.status === "streaming";
  }, "the regenerate to run");
  // Another tab resumes the chat: the answer running is the regenerate, not the newest turn
  // (the outputs' turn of the first answer, at rest).
  const stream = await new DefaultChatTransport({ api: API }).reconnectToStream({ chatId: chat.id });
  assert.ok(stream, "a running answer to resume");
  const chunks = [];
  let message;
  const seen = stream.pipeThrough(new TransformStream({
    transform(chunk, controller) { chunks.push(chunk); controller.enqueue(chunk); },
  }));
  for await (const snapshot of readUIMessageStream({ stream: seen })) message = snapshot;
  assert.equal(chunks.at(-1).finishReason, "tool-calls");
  assert.deepEqual(toolParts(message).map((p) => p.toolCallId), firstIds);
  const facts = message.parts.find((p) => p.type === "data-broker").data;
  assert.deepEqual([facts.turnId, facts.attempt], [question.id, 2]);
  await regenerated;
  await waitFor(() => answered(chat), "the regenerated answer");
});

test("stop while a regenerate runs stops the regenerate", async () => {
  const slow = [{ ...CALLS[0], after: 20 }, { ...CALLS[1], after: 20 }];
  const { chat } = toolChat({ ask: { tool_calls: slow, tokens: 30, tokens_per_s: 20 } });
  await chat.sendMessage({ text: "What is the weather and the time in Oslo?" });
  await waitFor(() => answered(chat), "the first answer");
  const question = chat.messages[0];
  const followUp = chat.messages[1].parts.find((p) => p.type === "data-broker").data.turnId;
  const regenerated = chat.regenerate();
  await waitFor(async () => {
    const state = await turn(question.id);
    return state.attempts.length === 2 && state.status === "streaming";
  }, "the regenerate to run");
  const stopped = await fetch(`${API}/${chat.id}/stop`, { method: "POST" });
  assert.equal(stopped.status, 200);
  await regenerated;
  await waitFor(async () => (await turn(question.id)).status === "cancelled", "the stop");
  assert.equal((await turn(followUp)).status, "complete", "the turn at rest is left alone");
});

test("the broker refuses tools it cannot take, naming them", async () => {
  const response = await fetch(API, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      id: `c${ids()}`, trigger: "submit-message",
      messages: [{ id: `m${ids()}`, role: "user", parts: [{ type: "text", text: "hi" }] }],
      tools: { "get weather": { inputSchema: { type: "object" } } },
    }),
  });
  assert.equal(response.status, 400);
  const { error } = await response.json();
  assert.match(error.message, /^tools: 'get weather'/);
});
