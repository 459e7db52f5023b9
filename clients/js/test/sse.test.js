import { test } from "node:test";
import assert from "node:assert/strict";
import { SSEDecoder, decodeAll } from "../../../broker/static/js/index.js";

const STREAM =
  "retry: 1000\r\nid: 1\r\n\r\n: heartbeat\nid: 2\nevent: delta\ndata: {\"a\":1}\n\n" +
  "id: 3\revent: end\rdata: line one\rdata: line two\r\r" +
  "data: é ü 日本\n\n";

const EXPECTED = [
  { data: '{"a":1}', event: "delta", id: "2", retry: null },
  { data: "line one\nline two", event: "end", id: "3", retry: null },
  { data: "é ü 日本", event: "message", id: "3", retry: null },
];

test("decodes a whole stream with mixed line endings", () => {
  assert.deepEqual(decodeAll([STREAM]), EXPECTED);
});

test("any split of the bytes gives the same events", () => {
  const bytes = new TextEncoder().encode(STREAM);
  for (let i = 0; i <= bytes.length; i++) {
    for (const j of [i, Math.min(bytes.length, i + 1), Math.min(bytes.length, i + 3)]) {
      const chunks = [bytes.slice(0, i), bytes.slice(i, j), bytes.slice(j)];
      assert.deepEqual(decodeAll(chunks), EXPECTED, `split at ${i}/${j}`);
    }
  }
});

test("byte-at-a-time and string chunks agree", () => {
  const bytes = new TextEncoder().encode(STREAM);
  assert.deepEqual(decodeAll([...bytes].map((b) => Uint8Array.of(b))), EXPECTED);
  assert.deepEqual(decodeAll([...STREAM]), EXPECTED);
});

test("CR at a chunk end followed by LF is one line ending", () => {
  const decoder = new SSEDecoder();
  assert.deepEqual(decoder.feed("data: x\r"), []);
  const events = decoder.feed("\n\r");
  assert.equal(events.length, 1);
  assert.equal(events[0].data, "x");
});

test("retry, comments and id-only blocks update state without events", () => {
  const comments = [];
  const decoder = new SSEDecoder({ onComment: (c) => comments.push(c) });
  assert.deepEqual(decoder.feed("retry: 250\n: ping\n:raw\nid: 0009\n\n"), []);
  assert.equal(decoder.retry, 250);
  assert.equal(decoder.lastEventId, "0009");
  assert.equal(decoder.comments, 2);
  assert.deepEqual(comments, ["ping", "raw"]);
  // invalid retry values are ignored
  decoder.feed("retry: 1e3\nretry: -5\nretry:\n\n");
  assert.equal(decoder.retry, 250);
  // a block's own retry is reported on its event; later events inherit the id
  const [event] = decoder.feed("retry: 10\ndata: y\n\n");
  assert.deepEqual(event, { data: "y", event: "message", id: "0009", retry: 10 });
});

test("field parsing follows the spec", () => {
  const events = decodeAll(["\ufeffdata\ndata:no-space\ndata:  two\nunknown: z\nid: a\0b\n\n"]);
  assert.deepEqual(events, [{ data: "\nno-space\n two", event: "message", id: "", retry: null }]);
});

test("end() drops an unterminated event and an uncommitted id", () => {
  const decoder = new SSEDecoder();
  decoder.feed("id: 1\n\nid: 2\ndata: partial");
  decoder.end();
  assert.equal(decoder.lastEventId, "1");
  assert.deepEqual(decoder.feed("data: next\n\n"), [
    { data: "next", event: "message", id: "1", retry: null },
  ]);
});
