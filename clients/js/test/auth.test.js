import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BrokerClient, BrokerHTTPError, ReattachExhausted, attachEventSource,
} from "../../../broker/static/js/index.js";

const enc = new TextEncoder();
const KEY = "key-acme-0123456789abcdef";
const frame = (id, type, data) => `id: ${id}\nevent: ${type}\ndata: ${JSON.stringify(data)}\n\n`;

function sse(chunks, { fail = null } = {}) {
  const body = new ReadableStream({
    pull(controller) {
      if (chunks.length) controller.enqueue(enc.encode(chunks.shift()));
      else if (fail) controller.error(fail);
      else controller.close();
    },
  });
  return new Response(body, { headers: { "content-type": "text/event-stream" } });
}

const refusal = (status, code, headers = {}) =>
  Response.json({ error: { code, message: `says ${code}` } }, { status, headers });

/** A fetch that answers from `script` in order and records each request. */
function fakeFetch(script) {
  const calls = [];
  const fetch = async (url, init = {}) => {
    calls.push({
      url, headers: { ...init.headers }, method: init.method ?? "GET",
      body: init.body === undefined ? undefined : JSON.parse(init.body), at: Date.now(),
    });
    const next = script.shift();
    if (!next) throw new Error(`unexpected request ${url}`);
    return typeof next === "function" ? next(init) : next;
  };
  return { fetch, calls };
}

const fast = { baseDelay: 1, maxDelay: 5, random: () => 0.5 };
const end = (id) => frame(id, "end", { attempt: 1, status: "complete" });

async function collect(iterable) {
  const out = [];
  for await (const item of iterable) out.push(item);
  return out;
}

test("apiKey goes out as a bearer credential on every call, reconnects included", async () => {
  const turn = { turn_id: "t", stream_id: "s", links: {} };
  const { fetch, calls } = fakeFetch([
    Response.json(turn, { status: 201 }),
    Response.json({ status: "streaming" }),
    Response.json({ status: "cancelled" }),
    Response.json({ attempt: 2 }, { status: 201 }),
    Response.json({ events: [], next_offset: "0", up_to_date: true, closed: false }),
    sse([frame("0001", "delta", { attempt: 1, text: "a" })], { fail: new TypeError("network") }),
    sse([end("0002")]),
  ]);
  const client = new BrokerClient("http://b", { fetch, policy: fast, apiKey: KEY });
  await client.startTurn({ conversationId: "c", turnId: "t", messages: [] });
  await client.getTurn("t");
  await client.cancel("t");
  await client.retry("t", "regenerate");
  await client.catchUp("s");
  const events = await collect(client.attach("s"));
  assert.deepEqual(events.map((e) => e.id), ["0001", "0002"]);
  assert.equal(calls.length, 7);
  for (const call of calls) {
    assert.equal(call.headers.Authorization, `Bearer ${KEY}`, call.url);
    assert.ok(!call.url.includes("token="), call.url);
  }
});

test("without an apiKey no Authorization is sent, and one may be set later", async () => {
  const { fetch, calls } = fakeFetch([Response.json({}), Response.json({})]);
  const client = new BrokerClient("", { fetch });
  await client.getTurn("t");
  client.apiKey = KEY;
  await client.getTurn("t");
  assert.equal(calls[0].headers.Authorization, undefined);
  assert.equal(calls[1].headers.Authorization, `Bearer ${KEY}`);
});

test("mintAttachToken posts its options and returns an absolute stream URL", async () => {
  const minted = {
    token: "x.y.z", turn_id: "t/1", stream_id: "st_1", expires_at: 1900000000, one_viewer: true,
    links: { stream: "/v1/streams/st_1?token=x.y.z" },
  };
  const { fetch, calls } = fakeFetch([
    Response.json(minted, { status: 201 }),
    Response.json({ ...minted, one_viewer: false }, { status: 201 }),
  ]);
  const client = new BrokerClient("http://b/", { fetch, apiKey: KEY });
  const token = await client.mintAttachToken("t/1", { ttlS: 600, oneViewer: true });
  await client.mintAttachToken("t/1");
  assert.equal(calls[0].method, "POST");
  assert.equal(calls[0].url, "http://b/v1/turns/t%2F1/attach-tokens");
  assert.deepEqual(calls[0].body, { ttl_s: 600, one_viewer: true });
  assert.deepEqual(calls[1].body, { one_viewer: false });
  assert.equal(calls[0].headers.Authorization, `Bearer ${KEY}`);
  assert.equal(token.token, "x.y.z");
  assert.equal(token.one_viewer, true);
  assert.equal(token.streamUrl, "http://b/v1/streams/st_1?token=x.y.z");
});

test("the token goes in the stream URL, attach and catchUp, without the API key", async () => {
  const client0 = new BrokerClient("http://b", { apiKey: KEY });
  assert.equal(client0.streamUrl("st 1"), "http://b/v1/streams/st%201");
  assert.equal(client0.streamUrl("s", "-1"), "http://b/v1/streams/s?offset=-1");
  assert.equal(client0.streamUrl("s", "0042", "a+b/c"), "http://b/v1/streams/s?offset=0042&token=a%2Bb%2Fc");
  assert.equal(client0.streamUrl("s", null, "t.o.k"), "http://b/v1/streams/s?token=t.o.k");

  const { fetch, calls } = fakeFetch([
    Response.json({ events: [], next_offset: "0", up_to_date: true, closed: true }),
    sse([frame("0001", "delta", { attempt: 1, text: "a" })], { fail: new TypeError("network") }),
    sse([end("0002")]),
  ]);
  const client = new BrokerClient("http://b", { fetch, policy: fast, apiKey: KEY });
  await client.catchUp("s", "-1", { token: "t.o.k" });
  await collect(client.attach("s", { token: "t.o.k" }));
  assert.deepEqual(calls.map((c) => c.url), [
    "http://b/v1/streams/s?format=json&offset=-1&token=t.o.k",
    "http://b/v1/streams/s?offset=-1&token=t.o.k",
    "http://b/v1/streams/s?offset=0001&token=t.o.k",
  ]);
  for (const call of calls) assert.equal(call.headers.Authorization, undefined);
  assert.equal(calls[2].headers["Last-Event-ID"], "0001");
});

for (const [status, code] of [[401, "bad_credentials"], [401, "token_expired"], [403, "wrong_stream"]]) {
  test(`${status} ${code} on a reconnect stops attach at once, keeping the code`, async () => {
    const { fetch, calls } = fakeFetch([
      sse([frame("0001", "delta", { attempt: 1, text: "a" })], { fail: new TypeError("network") }),
      refusal(status, code, status === 401 ? { "www-authenticate": "Bearer" } : {}),
      sse([end("0002")]), // never asked for
    ]);
    const client = new BrokerClient("", { fetch, policy: fast, apiKey: KEY });
    const seen = [];
    await assert.rejects(
      (async () => {
        for await (const event of client.attach("s")) seen.push(event.id);
      })(),
      (err) => {
        assert.ok(err instanceof BrokerHTTPError);
        assert.equal(err.status, status);
        assert.equal(err.code, code);
        return true;
      },
    );
    assert.deepEqual(seen, ["0001"]);
    assert.equal(calls.length, 2);
  });
}

test("typed errors of one-shot calls keep the code and the Retry-After", async () => {
  const { fetch } = fakeFetch([
    refusal(401, "unauthorized", { "www-authenticate": "Bearer" }),
    refusal(429, "too_many_streams", { "retry-after": "7" }),
    refusal(403, "read_only"),
  ]);
  const client = new BrokerClient("", { fetch });
  await assert.rejects(client.getTurn("t"), { status: 401, code: "unauthorized", retryAfter: null });
  await assert.rejects(
    client.startTurn({ conversationId: "c", messages: [] }),
    { name: "BrokerHTTPError", status: 429, code: "too_many_streams", retryAfter: 7 },
  );
  await assert.rejects(client.mintAttachToken("t"), { status: 403, code: "read_only" });
});

test("429 on attach waits out Retry-After instead of retrying at once", async () => {
  const { fetch, calls } = fakeFetch([
    refusal(429, "rate_limited", { "retry-after": "1" }),
    sse([end("0001")]),
  ]);
  const client = new BrokerClient("", { fetch, policy: fast });
  const reconnects = [];
  const events = await collect(client.attach("s", { onReconnect: (info) => reconnects.push(info) }));
  assert.deepEqual(events.map((e) => e.type), ["end"]);
  assert.equal(reconnects.length, 1);
  assert.equal(reconnects[0].error.code, "rate_limited");
  assert.ok(reconnects[0].delay >= 1000, `waited ${reconnects[0].delay} ms`);
  assert.ok(calls[1].at - calls[0].at >= 950, `reconnected after ${calls[1].at - calls[0].at} ms`);
});

test("429 without Retry-After waits at least the base delay; a huge one throws", async () => {
  let { fetch } = fakeFetch([refusal(429, "rate_limited"), sse([end("0001")])]);
  const policy = { baseDelay: 40, maxDelay: 40, random: () => 0 };
  const reconnects = [];
  await collect(new BrokerClient("", { fetch, policy }).attach("s", {
    onReconnect: (info) => reconnects.push(info),
  }));
  assert.deepEqual(reconnects.map((r) => r.delay), [40]); // jitter alone would have said 0

  ({ fetch } = fakeFetch([refusal(429, "rate_limited", { "retry-after": "3600" })]));
  await assert.rejects(
    collect(new BrokerClient("", { fetch, policy: fast }).attach("s")),
    { status: 429, code: "rate_limited", retryAfter: 3600 },
  );
});

test("repeated 429s count as failures and give up", async () => {
  const { fetch, calls } = fakeFetch([
    refusal(429, "rate_limited"), refusal(429, "rate_limited"), refusal(429, "rate_limited"),
  ]);
  const client = new BrokerClient("", { fetch, policy: { ...fast, maxRetries: 2 } });
  await assert.rejects(collect(client.attach("s")), (err) => {
    assert.ok(err instanceof ReattachExhausted);
    assert.equal(err.cause.code, "rate_limited");
    return true;
  });
  assert.equal(calls.length, 3);
});

test("token_in_use: a conflict at first, waited out after our own drop", async () => {
  let { fetch, calls } = fakeFetch([refusal(409, "token_in_use")]);
  await assert.rejects(
    collect(new BrokerClient("", { fetch, policy: fast }).attach("s", { token: "t" })),
    { status: 409, code: "token_in_use" },
  );
  assert.equal(calls.length, 1);

  ({ fetch, calls } = fakeFetch([
    sse([frame("0001", "delta", { attempt: 1, text: "a" })], { fail: new TypeError("network") }),
    refusal(409, "token_in_use"),
    sse([end("0002")]),
  ]));
  const events = await collect(new BrokerClient("", { fetch, policy: fast }).attach("s", { token: "t" }));
  assert.deepEqual(events.map((e) => e.id), ["0001", "0002"]);
  assert.equal(calls[2].headers["Last-Event-ID"], "0001");
});

test("attachEventSource puts the token in the URL", () => {
  const urls = [];
  class FakeES {
    constructor(url) {
      urls.push(url);
      this.readyState = 0;
    }
    addEventListener() {}
    close() {}
  }
  attachEventSource("/v1/streams/s?offset=-1", { EventSource: FakeES, token: "a+b" });
  attachEventSource("/v1/streams/s", { EventSource: FakeES, token: "t.o.k" });
  attachEventSource("/v1/streams/s", { EventSource: FakeES });
  assert.deepEqual(urls, [
    "/v1/streams/s?offset=-1&token=a%2Bb", "/v1/streams/s?token=t.o.k", "/v1/streams/s",
  ]);
});

test("approve, deny and decide post the decision; the one that stands comes back, a 409 too", async () => {
  const standing = { approval_id: "apr_1", decision: "approve", reason: null, by: "person" };
  const { fetch, calls } = fakeFetch([
    Response.json({ turn_id: "t/1", ...standing }),
    Response.json(
      { error: { code: "approval_decided", message: "decided already" }, turn_id: "t/1", ...standing },
      { status: 409 },
    ),
    Response.json({ turn_id: "t/1", ...standing }),
    Response.json({ error: { code: "not_found", message: "unknown approval" } }, { status: 404 }),
  ]);
  const client = new BrokerClient("http://b", { fetch, apiKey: KEY });
  assert.deepEqual((await client.approve("t/1", "apr_1")).decision, "approve");
  const other = await client.deny("t/1", "apr_1", { reason: "too much" });
  assert.deepEqual(other, standing, "another decision stands: it is returned, not thrown");
  await client.decide("t/1", "apr_1", "approve", { token: "t.o.k" });
  await assert.rejects(client.approve("t/1", "apr_9"), { status: 404 });
  await assert.rejects(client.decide("t/1", "apr_1", "maybe"), TypeError);
  assert.equal(calls[0].method, "POST");
  assert.equal(calls[0].url, "http://b/v1/turns/t%2F1/approvals/apr_1");
  assert.deepEqual(calls[0].body, { decision: "approve" });
  assert.deepEqual(calls[1].body, { decision: "deny", reason: "too much" });
  assert.equal(calls[0].headers.Authorization, `Bearer ${KEY}`);
  // An approve-scoped attach token goes in the query, without the API key.
  assert.equal(calls[2].url, "http://b/v1/turns/t%2F1/approvals/apr_1?token=t.o.k");
  assert.equal(calls[2].headers.Authorization, undefined);
  assert.equal(calls.length, 4, "a bad decision is refused before any call");
});

test("mintAttachToken asks for the approve scope when told", async () => {
  const minted = { token: "x", turn_id: "t", stream_id: "s", links: { stream: "/v1/streams/s?token=x" } };
  const { fetch, calls } = fakeFetch([Response.json(minted, { status: 201 })]);
  await new BrokerClient("http://b", { fetch }).mintAttachToken("t", { approve: true });
  assert.deepEqual(calls[0].body, { one_viewer: false, approve: true });
});
