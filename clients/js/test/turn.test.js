import { test } from "node:test";
import assert from "node:assert/strict";
import { Transcript, TurnState } from "../../../broker/static/js/index.js";

let seq = 0;
const ev = (type, attempt, data = {}) => ({
  id: String(++seq).padStart(6, "0"), type, attempt, data: { attempt, ...data },
});

test("continue extends the partial text, regenerate replaces it", () => {
  const turn = new TurnState("t1");
  turn.apply(ev("attempt", 1, { strategy: "initial" }));
  turn.apply(ev("delta", 1, { text: "Hello" }));
  turn.apply(ev("end", 1, { status: "interrupted" }));
  assert.equal(turn.text, "Hello");
  assert.equal(turn.status, "interrupted");

  turn.apply(ev("attempt", 2, { strategy: "continue" }));
  assert.equal(turn.status, null, "a new attempt is running");
  assert.equal(turn.prefix, "Hello");
  turn.apply(ev("delta", 2, { text: " world" }));
  turn.apply(ev("end", 2, { status: "interrupted" }));
  assert.equal(turn.text, "Hello world");

  turn.apply(ev("attempt", 3, { strategy: "regenerate" }));
  assert.equal(turn.text, "");
  turn.apply(ev("delta", 3, { text: "Fresh" }));
  turn.apply(ev("end", 3, { status: "complete" }));
  assert.equal(turn.text, "Fresh");
  assert.equal(turn.status, "complete");
  assert.equal(turn.textOf(2), "Hello world", "older slots are kept");
});

test("a late event of an old attempt cannot append to the new one", () => {
  const turn = new TurnState("t2");
  turn.apply(ev("attempt", 1, { strategy: "initial" }));
  turn.apply(ev("delta", 1, { text: "old" }));
  turn.apply(ev("attempt", 2, { strategy: "regenerate" }));
  turn.apply(ev("delta", 2, { text: "new" }));
  turn.apply(ev("delta", 1, { text: " late" }));
  turn.apply(ev("end", 1, { status: "interrupted" }));
  assert.equal(turn.text, "new");
  assert.equal(turn.status, null, "the old attempt's end says nothing about the new one");
  assert.equal(turn.textOf(1), "old late");
});

test("replays are ignored and state survives JSON", () => {
  const turn = new TurnState("t3");
  const first = ev("delta", 1, { text: "a" });
  assert.ok(turn.apply(first));
  assert.equal(turn.apply(first), false);
  const copy = TurnState.fromJSON(JSON.parse(JSON.stringify(turn)));
  copy.apply(first);
  copy.apply(ev("delta", 1, { text: "b" }));
  assert.equal(copy.text, "ab");
  assert.equal(turn.text, "a");
});

test("a transcript keeps turns in separate slots", () => {
  const transcript = new Transcript();
  transcript.apply("a", ev("delta", 1, { text: "one" }));
  transcript.apply("b", ev("delta", 1, { text: "two" }));
  assert.deepEqual([...transcript.turns.keys()], ["a", "b"]);
  assert.equal(transcript.turn("a").text, "one");
  assert.equal(transcript.turn("b").text, "two");
});

test("approval requests wait until their decision comes, and survive toJSON", () => {
  const turn = new TurnState("t-approval");
  turn.apply(ev("attempt", 1, { strategy: "initial" }));
  const request = { approval_id: "apr_1", call_id: "c1", name: "pay", ordinal: 0, args: { amount: 500 } };
  turn.apply(ev("approval_request", 1, request));
  assert.deepEqual(turn.pendingApprovals.map((r) => r.approval_id), ["apr_1"]);
  assert.equal(turn.pendingApprovals[0].name, "pay");
  const kept = TurnState.fromJSON(JSON.parse(JSON.stringify(turn)));
  assert.deepEqual(kept.pendingApprovals.map((r) => r.approval_id), ["apr_1"], "a reload keeps it");
  turn.apply(ev("approval_decision", 1, { approval_id: "apr_1", decision: "deny", reason: "no", by: "person" }));
  assert.deepEqual(turn.pendingApprovals, []);
  assert.equal(turn.approvals.get("apr_1").decision.decision, "deny");
  assert.equal(turn.approvals.get("apr_1").request.args.amount, 500);
  assert.equal(turn.status, null, "the attempt goes on after a decision");
});
