// @microsoft/fetch-event-source, with the loop its documentation shows: onopen checks the
// response, onmessage JSON.parses every message, onclose throws to reconnect, onerror lets it
// retry. The library resends the last event id it saw by itself.
import assert from "node:assert/strict";
import { test } from "node:test";
import { fetchEventSource } from "@microsoft/fetch-event-source";
import { checkRead, cutProxy, liveTurn } from "./support.js";

// Written for browsers: it reaches for window.fetch, window.setTimeout and the document's
// visibility. Node has the first two on globalThis; a document that is never hidden will do.
globalThis.window ??= globalThis;
globalThis.document ??= Object.assign(new EventTarget(), { hidden: false });

class RetriableError extends Error {}
class FatalError extends Error {}

test("fetch-event-source reads across two cuts without a gap, a repeat or a parse error", {
  timeout: 30_000,
}, async () => {
  const { streamId, tail } = await liveTurn("fetch-event-source");
  const proxy = await cutProxy();
  const seen = [];
  const errors = [];
  const opened = [];
  let cuts = 0;
  const stop = new AbortController();
  try {
    await fetchEventSource(`${proxy.url}/v1/streams/${streamId}?offset=now`, {
      signal: stop.signal,
      async onopen(response) {
        opened.push(response.status);
        if (response.ok && response.headers.get("content-type") === "text/event-stream") {
          return; // everything's good
        } else if (response.status >= 400 && response.status < 500 && response.status !== 429) {
          throw new FatalError(`status ${response.status}`);
        } else {
          throw new RetriableError(`status ${response.status}`);
        }
      },
      onmessage(message) {
        let data;
        try {
          data = JSON.parse(message.data);
        } catch (error) {
          errors.push(`${message.event} ${JSON.stringify(message.data)}: ${error.message}`);
        }
        seen.push([message.event || "message", message.id, data]);
        const read = seen.filter(([type]) => type !== "resume_point").length;
        if (cuts === 0 && message.event === "resume_point") {
          cuts = 1;
          proxy.cut({ reset: true }); // before the first event: the resume point must hold
        } else if (cuts === 1 && read >= 5) {
          cuts = 2;
          proxy.cut({ reset: false });
        }
        if (message.event === "end") stop.abort(); // the answer is complete
      },
      onclose() {
        throw new RetriableError("the server closed the stream"); // reconnect
      },
      onerror(error) {
        if (error instanceof FatalError) throw error; // stop
        // anything else: retry, after the server's retry: interval
      },
    });
  } finally {
    await proxy.close();
  }
  assert.deepEqual(errors, []);
  assert.equal(cuts, 2);
  assert.deepEqual(opened, opened.map(() => 200)); // the documented onopen accepted each
  await checkRead({ seen, streamId, tail, proxy });
});
