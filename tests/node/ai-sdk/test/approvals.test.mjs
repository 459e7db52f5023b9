// Tool approvals through the AI SDK door, with the package's own Chat (what useChat runs): a
// server tool that waits for a person shows as an approval request; addToolApprovalResponse
// sends the chat again by itself, the broker decides, and the answer goes on in the message.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { test } from "node:test";

import { Chat } from "@ai-sdk/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithApprovalResponses } from "ai";

const BASE = process.env.BROKER_URL;
assert.ok(BASE, "BROKER_URL must name a running broker (with send_payment, approval always)");
const API = `${BASE}/v1/ui/chat`;

const ids = () => randomUUID().replaceAll("-", "").slice(0, 16);
// The simulated model pays three words in, then goes on with five more.
const PAY = [{ name: "send_payment", args: { to: "bob", amount: 500 }, after: 3 }];

function textOf(message) {
  return message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
}

function payment(message) {
  return message.parts.find((p) => p.type === "tool-send_payment");
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

function payChat(id = `c${ids()}`) {
  return new Chat({
    id,
    transport: new DefaultChatTransport({
      api: API,
      prepareSendMessagesRequest: ({ id, messages, body, trigger, messageId }) => ({
        body: { ...body, id, messages, trigger, messageId,
                params: { simulate: { seed: 5, tokens: 8, tokens_per_s: 0, tool_calls: PAY } } },
      }),
    }),
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
  });
}

const pending = (chat) => chat.status === "ready" && chat.messages.length > 0
  && payment(chat.messages.at(-1))?.state === "approval-requested";

async function ask(chat) {
  await chat.sendMessage({ text: "Pay bob 500" });
  await waitFor(() => pending(chat), "the approval request");
  const question = chat.messages[0];
  const state = await turn(question.id);
  assert.equal(state.status, "awaiting_approval");
  const part = payment(chat.messages[1]);
  assert.equal(part.approval.id, state.approvals[0].approval_id);
  assert.equal(part.toolCallId, state.approvals[0].call_id);
  assert.deepEqual(part.input, { to: "bob", amount: 500 });
  assert.equal(part.providerExecuted, true, "the broker's call: the client never runs it");
  return { question, part };
}

test("an approval request is answered with addToolApprovalResponse; the answer goes on", async () => {
  const chat = payChat();
  const { question, part } = await ask(chat);
  await chat.addToolApprovalResponse({ id: part.approval.id, approved: true });
  await waitFor(() => chat.status === "ready" && payment(chat.messages[1]).state === "output-available",
                "the payment's output");
  assert.equal(chat.messages.length, 2, "the same message went on");
  const answer = chat.messages[1];
  assert.equal(answer.id, `${question.id}-reply`);
  assert.equal(payment(answer).approval.approved, true);
  assert.deepEqual(payment(answer).output, { payment_id: "pay_1" });
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.equal(textOf(answer), state.canonical.text);
});

test("a deny shows as output-denied and the model goes on without the payment", async () => {
  const chat = payChat();
  const { question, part } = await ask(chat);
  await chat.addToolApprovalResponse({ id: part.approval.id, approved: false, reason: "too much" });
  await waitFor(() => chat.status === "ready" && payment(chat.messages[1]).state === "output-denied",
                "the denied part");
  assert.equal(payment(chat.messages[1]).approval.approved, false);
  assert.equal(payment(chat.messages[1]).approval.reason, "too much");
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.equal(textOf(chat.messages[1]), state.canonical.text);
});

test("a reload while the approval waits shows it again, and is answered from there", async () => {
  const first = payChat();
  const { question, part } = await ask(first);
  // Another page (a reload, another device): the same chat, resumed from the broker alone.
  const again = payChat(first.id);
  await again.resumeStream();
  await waitFor(() => pending(again), "the request again after the reload");
  assert.equal(payment(again.messages[0]).approval.id, part.approval.id);
  await again.addToolApprovalResponse({ id: part.approval.id, approved: true });
  await waitFor(() => again.status === "ready"
                && payment(again.messages[0]).state === "output-available", "the payment's output");
  const state = await turn(question.id);
  assert.equal(state.status, "complete");
  assert.equal(textOf(again.messages[0]), state.canonical.text);
  // The same answer sent again (the first page) stands: one decision, the same answer.
  await first.addToolApprovalResponse({ id: part.approval.id, approved: false });
  await waitFor(() => first.status === "ready"
                && payment(first.messages[1]).state === "output-available", "the decision that stands");
  assert.equal(payment(first.messages[1]).approval.approved, true, "the first decision won");
});
