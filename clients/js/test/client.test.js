import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BrokerClient, BrokerHTTPError, ReattachExhausted, attachEventSource, backoffDelay,
} from "../../../broker/static/js/index.js";

const enc = new TextEncoder();
const frame = (id, type, data) => `id: ${id}\nevent: ${type}\ndata: ${JSON.stringify(data)}\n\n`;

/** A response whose body yields `chunks`, then ends (or fails with `fail`). */
function sse(chunks, { fail = null, status = 200 } = {}) {
  const body = new ReadableStream({
    pull(controller) {
      if (chunks.length) controller.enqueue(enc.encode(chunks.shift()));
      else if (fail) controller.error(fail);
      else controller.close();
    },
  });
  return new Response(body, { status, headers: { "content-type": "text/event-stream" } });
}

/** A fetch that answers from `script` in order and records each request. */
function fakeFetch(script) {
  const calls = [];
  const fetch = async (url, init = {}) => {
    calls.push({ url, headers: { ...init.headers }, method: init.method ?? "GET" });
    const next = script.shift();
    if (!next) throw new Error("unexpected request");
    return typeof next === "function" ? next(init) : next;
  };
  return { fetch, calls };
}

const fast = { baseDelay: 1, maxDelay: 5, random: () => 0.5 };

async function collect(iterable) {
  const out = [];
  for await (const item of iterable) out.push(item);
  return out;
}

test("backoff is full jitter, capped", () => {
  assert.equal(backoffDelay(1, 100, 1000, () => 1), 100);
  assert.equal(backoffDelay(3, 100, 1000, () => 1), 400);
  assert.equal(backoffDelay(10, 100, 1000, () => 1), 1000);
  assert.equal(backoffDelay(1000, 100, 1000, () => 0.25), 250);
  assert.equal(backoffDelay(2, 100, 1000, () => 0), 0);
});

test("reattaches with Last-Event-ID after a drop and stops after end", async () => {
  const { fetch, calls } = fakeFetch([
    sse(["retry: 4\n", "id: 0001\n\n", frame("0002", "attempt", { attempt: 1 }),
      frame("0003", "delta", { attempt: 1, text: "a" })], { fail: new TypeError("network") }),
    sse([frame("0003", "delta", { attempt: 1, text: "a" }), // a replay: dropped
      frame("0004", "delta", { attempt: 1, text: "b" }),
      frame("0005", "end", { attempt: 1, status: "complete" })]),
  ]);
  const client = new BrokerClient("http://b", { fetch, policy: fast });
  const reconnects = [];
  const stats = {};
  const events = await collect(
    client.attach("st_1", { stats, onReconnect: (info) => reconnects.push(info) }),
  );
  assert.deepEqual(events.map((e) => e.id), ["0002", "0003", "0004", "0005"]);
  assert.equal(events[1].attempt, 1);
  assert.equal(calls.length, 2);
  assert.equal(calls[0].url, "http://b/v1/streams/st_1?offset=-1");
  assert.equal(calls[0].headers["Last-Event-ID"], undefined);
  assert.equal(calls[1].headers["Last-Event-ID"], "0003");
  assert.equal(calls[1].url, "http://b/v1/streams/st_1?offset=0003");
  // the server's retry: 4 is the backoff base: 0.5 * 4 * 2^0
  assert.equal(reconnects.length, 1);
  assert.equal(reconnects[0].delay, 2);
  assert.equal(stats.duplicates, 1);
  assert.equal(stats.reconnects, 1);
});

test("an id-only frame moves the resume point", async () => {
  const { fetch, calls } = fakeFetch([
    sse(["id: 0042\n\n"]), // closes without an end: a failure
    new Response(null, { status: 204 }),
  ]);
  const client = new BrokerClient("", { fetch, policy: fast });
  assert.deepEqual(await collect(client.attach("s", { offset: "now" })), []);
  assert.equal(calls[0].url, "/v1/streams/s?offset=now");
  assert.equal(calls[1].headers["Last-Event-ID"], "0042");
});

test("a resume_point event moves the resume point and is not yielded", async () => {
  const { fetch, calls } = fakeFetch([
    sse(["retry: 4\n", frame("0042", "resume_point", { offset: "0042" })]), // no end: a failure
    sse(["retry: 4\n: ping\n", frame("0043", "delta", { attempt: 1, text: "a" }),
      frame("0044", "end", { attempt: 1, status: "complete" })]),
  ]);
  const client = new BrokerClient("", { fetch, policy: fast });
  const events = await collect(client.attach("s", { offset: "now" }));
  assert.deepEqual(events.map((e) => [e.id, e.type]), [["0043", "delta"], ["0044", "end"]]);
  assert.equal(calls[0].url, "/v1/streams/s?offset=now");
  assert.equal(calls[1].headers["Last-Event-ID"], "0042");
});

test("204 stops at once; 404 throws; 503 is retried", async () => {
  let { fetch } = fakeFetch([new Response(null, { status: 204 })]);
  assert.deepEqual(await collect(new BrokerClient("", { fetch }).attach("s")), []);

  ({ fetch } = fakeFetch([
    Response.json({ error: { code: "stream_not_found", message: "no such stream" } }, { status: 404 }),
  ]));
  await assert.rejects(collect(new BrokerClient("", { fetch }).attach("s")), (err) => {
    assert.ok(err instanceof BrokerHTTPError);
    assert.equal(err.status, 404);
    assert.equal(err.code, "stream_not_found");
    return true;
  });

  ({ fetch } = fakeFetch([
    new Response("busy", { status: 503 }),
    sse([frame("0001", "end", { attempt: 1, status: "complete" })]),
  ]));
  const events = await collect(new BrokerClient("", { fetch, policy: fast }).attach("s"));
  assert.deepEqual(events.map((e) => e.type), ["end"]);
});

test("a replaced event ends a one-viewer read with a 409, without reconnecting", async () => {
  const replaced = 'event: replaced\ndata: {"code":"viewer_replaced","message":"taken over"}\n\n';
  const { fetch, calls } = fakeFetch([
    sse([frame("0001", "delta", { attempt: 1, text: "a" }), replaced]),
  ]);
  const seen = [];
  await assert.rejects(
    (async () => {
      for await (const event of new BrokerClient("", { fetch, policy: fast }).attach("s")) {
        seen.push(event.type);
      }
    })(),
    (err) => {
      assert.ok(err instanceof BrokerHTTPError);
      assert.equal(err.status, 409);
      assert.equal(err.code, "viewer_replaced");
      return true;
    },
  );
  assert.deepEqual(seen, ["delta"]);
  assert.equal(calls.length, 1);
});

test("gives up after maxRetries consecutive failures", async () => {
  const fetch = async () => {
    throw new TypeError("connection refused");
  };
  const client = new BrokerClient("", { fetch, policy: { ...fast, maxRetries: 3 } });
  await assert.rejects(collect(client.attach("s")), (err) => {
    assert.ok(err instanceof ReattachExhausted);
    assert.equal(err.failures, 4);
    return true;
  });
});

test("an AbortSignal ends the read quietly, even mid-stream", async () => {
  const controller = new AbortController();
  const fetch = async (url, init) =>
    new Response(
      new ReadableStream({
        start(c) {
          c.enqueue(enc.encode(frame("0001", "delta", { attempt: 1, text: "x" })));
          init.signal.addEventListener("abort", () => c.error(init.signal.reason));
        },
      }),
      { headers: { "content-type": "text/event-stream" } },
    );
  const client = new BrokerClient("", { fetch });
  const seen = [];
  for await (const event of client.attach("s", { signal: controller.signal })) {
    seen.push(event.id);
    setTimeout(() => controller.abort(), 5);
  }
  assert.deepEqual(seen, ["0001"]);
});

test("onConnect's drop cuts one connection and the reader reattaches", async () => {
  let drop;
  const hanging = (init) =>
    new Response(
      new ReadableStream({
        start(c) {
          c.enqueue(enc.encode(frame("0001", "delta", { attempt: 1, text: "x" })));
          init.signal.addEventListener("abort", () => c.error(init.signal.reason));
        },
      }),
      { headers: { "content-type": "text/event-stream" } },
    );
  const { fetch, calls } = fakeFetch([
    hanging,
    sse([frame("0002", "end", { attempt: 1, status: "complete" })]),
  ]);
  const client = new BrokerClient("", { fetch, policy: fast });
  const ids = [];
  for await (const event of client.attach("s", { onConnect: (d) => (drop = d) })) {
    ids.push(event.id);
    if (event.id === "0001") drop();
  }
  assert.deepEqual(ids, ["0001", "0002"]);
  assert.equal(calls[1].headers["Last-Event-ID"], "0001");
});

test("turn calls post the right bodies", async () => {
  const { fetch, calls } = fakeFetch([
    Response.json({ turn_id: "t", stream_id: "s" }, { status: 201 }),
    Response.json({ status: "cancelled" }),
    Response.json({ attempt: 2 }),
  ]);
  const client = new BrokerClient("http://b/", { fetch });
  const turn = await client.startTurn({
    conversationId: "c", turnId: "t", messages: [{ role: "user", content: "hi" }],
  });
  assert.equal(turn.created, true);
  assert.equal((await client.cancel("t")).status, "cancelled");
  assert.equal((await client.retry("t", "continue")).attempt, 2);
  await assert.rejects(client.retry("t", "again"), TypeError);
  assert.deepEqual(calls.map((c) => `${c.method} ${c.url}`), [
    "POST http://b/v1/turns", "POST http://b/v1/turns/t/cancel", "POST http://b/v1/turns/t/attempts",
  ]);
});

test("attachEventSource parses events, drops replays and closes after end", () => {
  class FakeES {
    constructor(url) {
      this.url = url;
      this.readyState = 1;
      this.listeners = {};
      FakeES.last = this;
    }
    addEventListener(type, fn) {
      (this.listeners[type] ??= []).push(fn);
    }
    close() {
      this.readyState = 2;
    }
    emit(type, id, data) {
      for (const fn of this.listeners[type] ?? []) {
        fn({ type, lastEventId: id, data: JSON.stringify(data) });
      }
    }
  }
  const events = [];
  let ended;
  const handle = attachEventSource("/v1/streams/s?offset=-1", {
    EventSource: FakeES, onEvent: (e) => events.push(e), onEnd: (e) => (ended = e),
  });
  const es = FakeES.last;
  es.emit("resume_point", "0000", { offset: "0000" }); // a resume point, not an event
  assert.equal(handle.lastEventId, "0000");
  for (const fn of es.listeners.error) fn({ type: "error" }); // a lost connection: no data
  assert.deepEqual(events, []);
  es.emit("delta", "0001", { attempt: 1, text: "a" });
  es.emit("delta", "0001", { attempt: 1, text: "a" });
  es.emit("end", "0002", { attempt: 1, status: "complete" });
  assert.deepEqual(events.map((e) => [e.id, e.type, e.attempt]), [["0001", "delta", 1], ["0002", "end", 1]]);
  assert.equal(ended.data.status, "complete");
  assert.equal(es.readyState, 2);
  assert.equal(handle.lastEventId, "0002");
});
