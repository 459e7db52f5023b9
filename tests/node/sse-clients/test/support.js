// What every SSE client test here shares: a live turn to read, a TCP proxy to cut, and the
// checks. BROKER_URL names a live broker (tests/test_sse_clients.py starts one, with a short
// `retry:` and heartbeat so that reconnects are quick and heartbeats fall between events).
import assert from "node:assert/strict";
import net from "node:net";
import zlib from "node:zlib";

export const base = process.env.BROKER_URL;
export const STREAM_TYPES = new Set([
  "attempt", "delta", "tool_call", "tool_result", "usage", "error", "end",
]);
const DEADLINE_MS = 15_000;

/** Poll `predicate` until it returns something truthy; throw after `ms`. */
export async function waitFor(predicate, what, ms = DEADLINE_MS) {
  const deadline = Date.now() + ms;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

async function page(streamId, offset) {
  const url = `${base}/v1/streams/${streamId}?format=json&offset=${encodeURIComponent(offset)}`;
  const response = await fetch(url);
  assert.equal(response.status, 200);
  return response.json();
}

/** Every event of a stream, read as JSON pages once the turn is at rest. */
export async function wholeStream(streamId) {
  const events = [];
  let offset = "-1";
  for (let pages = 0; pages < 100; pages += 1) {
    const answer = await page(streamId, offset);
    events.push(...answer.events.map((e) => [e.event, e.id, e.data]));
    offset = answer.next_offset;
    if (answer.closed) return events;
  }
  throw new Error("the stream did not close");
}

/** A turn under way, with a few events already stored (a read from `now` has a past to skip).
 * Returns its stream id and the stream's tail before any read. */
export async function liveTurn(turnId) {
  const response = await fetch(`${base}/v1/turns`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      conversation_id: "sse-clients",
      turn_id: turnId,
      messages: [{ role: "user", content: `read by ${turnId}` }],
      params: { simulate: { seed: turnId, tokens: 40, tokens_per_s: 30 } },
    }),
  });
  assert.equal(response.status, 201, await response.clone().text());
  const { stream_id: streamId } = await response.json();
  const past = await waitFor(async () => {
    const answer = await page(streamId, "-1");
    return answer.events.length >= 3 && answer.events;
  }, "the turn's first events");
  return { streamId, tail: past.at(-1).id };
}

/** A TCP proxy in front of the broker that the test can cut: `cut({ reset })` ends every live
 * connection with an RST (a dead path) or a FIN (a server closing mid-stream). */
export async function cutProxy() {
  const target = new URL(base);
  const live = new Set();
  const proxy = { accepted: 0, sent: [], received: [], url: "" };
  const server = net.createServer((client) => {
    proxy.accepted += 1;
    const upstream = net.connect(Number(target.port), target.hostname);
    const pair = { client, upstream };
    live.add(pair);
    const [sent, received] = [[], []];
    proxy.sent.push(sent);
    proxy.received.push(received);
    client.on("data", (chunk) => sent.push(chunk));
    upstream.on("data", (chunk) => received.push(chunk));
    client.pipe(upstream);
    upstream.pipe(client);
    const drop = () => {
      live.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on("error", drop).on("close", drop);
    upstream.on("error", drop).on("close", drop);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  proxy.url = `http://127.0.0.1:${server.address().port}`;
  proxy.cut = ({ reset }) => {
    const count = live.size;
    for (const pair of [...live]) {
      live.delete(pair);
      if (reset) pair.client.resetAndDestroy();
      else pair.client.end();
      pair.upstream.destroy();
    }
    return count;
  };
  // The request line of every request that came through (GETs: no bodies to skip).
  proxy.requests = () => proxy.sent.flatMap((chunks) =>
    Buffer.concat(chunks).toString("latin1").split("\r\n\r\n").slice(0, -1)
      .map((head) => head.split("\r\n")[0]));
  // The body of every response the server sent through, as far as it got, decoded.
  proxy.bodies = () => proxy.received.flatMap((chunks) => responses(Buffer.concat(chunks)));
  proxy.close = () => {
    proxy.cut({ reset: false });
    return new Promise((resolve) => server.close(resolve));
  };
  return proxy;
}

/** The checks every library must pass: `seen` is what its textbook loop got, [type, id, data]
 * (data already parsed with JSON.parse), `tail` the stream's tail before the read from `now`. */
export async function checkRead({ seen, streamId, tail, proxy, resumePoint = true }) {
  const resumes = seen.filter(([type]) => type === "resume_point");
  const events = seen.filter(([type]) => type !== "resume_point");
  for (const [type] of events) assert.ok(STREAM_TYPES.has(type), `an event of type ${type}`);
  const whole = await wholeStream(streamId);
  let start = tail;
  if (resumePoint) {
    // One resume point: the reattaches named their last event, never `now` again.
    assert.equal(resumes.length, 1, JSON.stringify(resumes));
    const [, id, data] = resumes[0];
    assert.deepEqual(data, { offset: id });
    assert.ok(id >= tail, `${id} is at or past the tail ${tail}`);
    start = id;
  }
  // No gap and no duplicate: exactly the stream's events after the resume point, in order.
  // (A client that keeps the resume point to itself: a run of the stream's last events, all
  // after the tail it had before the read.)
  const after = resumePoint
    ? whole.filter(([, id]) => id > start)
    : whole.slice(whole.length - events.length);
  assert.deepEqual(events, after);
  assert.ok(events[0][1] > start, `the first event ${events[0][1]} is past ${start}`);
  assert.equal(events.at(-1)[0], "end");
  assert.equal(events.at(-1)[2].status, "complete");
  const reads = proxy.requests().filter((line) => line.startsWith(`GET /v1/streams/${streamId}`));
  assert.ok(reads.length >= 3, `${reads.length} reads: two cuts, two reattaches`);
  assert.ok(proxy.bodies().some((body) => body.includes("\n: ping\n")), "heartbeats went by");
}

/** The bodies of the HTTP/1.1 responses of one connection's bytes: dechunked, gunzipped. */
function responses(data) {
  const bodies = [];
  for (;;) {
    const end = data.indexOf("\r\n\r\n");
    if (end < 0) return bodies;
    const headers = new Map(
      data.subarray(0, end).toString("latin1").split("\r\n").slice(1).map((line) => {
        const colon = line.indexOf(":");
        return [line.slice(0, colon).trim().toLowerCase(), line.slice(colon + 1).trim()];
      }),
    );
    data = data.subarray(end + 4);
    let body;
    if (headers.has("content-length")) {
      const size = Number(headers.get("content-length"));
      [body, data] = [data.subarray(0, size), data.subarray(size)];
    } else if (headers.get("transfer-encoding") === "chunked") {
      [body, data] = dechunk(data);
    } else {
      [body, data] = [data, Buffer.alloc(0)];
    }
    if (headers.get("content-encoding") === "gzip") {
      // As far as it got: a cut body has no gzip trailer.
      try {
        body = zlib.gunzipSync(body, { finishFlush: zlib.constants.Z_SYNC_FLUSH });
      } catch {
        body = Buffer.alloc(0); // cut before its first block
      }
    }
    bodies.push(body.toString("utf8"));
  }
}

function dechunk(data) {
  const parts = [];
  for (;;) {
    const eol = data.indexOf("\r\n");
    if (eol < 0) return [Buffer.concat(parts), Buffer.alloc(0)];
    const size = parseInt(data.subarray(0, eol).toString("latin1"), 16);
    const rest = data.subarray(eol + 2);
    if (size === 0) return [Buffer.concat(parts), rest.subarray(rest.indexOf("\r\n") + 2)];
    parts.push(rest.subarray(0, size));
    if (rest.length < size) return [Buffer.concat(parts), Buffer.alloc(0)];
    data = rest.subarray(size + 2);
  }
}
