// npm `eventsource`, with its textbook loop: a listener per event type that JSON.parses the
// data. It reattaches by itself after an RST and a FIN, sending its last event id.
import assert from "node:assert/strict";
import { test } from "node:test";
import { EventSource } from "eventsource";
import { STREAM_TYPES, checkRead, cutProxy, liveTurn } from "./support.js";

test("npm eventsource reads across two cuts without a gap, a repeat or a parse error", {
  timeout: 30_000,
}, async () => {
  const { streamId, tail } = await liveTurn("npm-eventsource");
  const proxy = await cutProxy();
  const seen = [];
  const errors = [];
  let cuts = 0;
  try {
    await new Promise((resolve) => {
      const source = new EventSource(`${proxy.url}/v1/streams/${streamId}?offset=now`);
      const onEvent = (event) => {
        // EventSource's own `error` event (a lost connection) shares the broker's `error`
        // event's name: only a message has data.
        if (!(event instanceof MessageEvent)) return;
        let data;
        try {
          data = JSON.parse(event.data);
        } catch (error) {
          errors.push(`${event.type} ${JSON.stringify(event.data)}: ${error.message}`);
        }
        seen.push([event.type, event.lastEventId, data]);
        const read = seen.filter(([type]) => type !== "resume_point").length;
        if (cuts === 0 && event.type === "resume_point") {
          cuts = 1;
          proxy.cut({ reset: true }); // before the first event: the resume point must hold
        } else if (cuts === 1 && read >= 5) {
          cuts = 2;
          proxy.cut({ reset: false });
        }
        if (event.type === "end") {
          source.close();
          resolve();
        }
      };
      for (const type of [...STREAM_TYPES, "resume_point"]) source.addEventListener(type, onEvent);
      source.onmessage = onEvent; // the broker sends no unnamed event: one would be a loose frame
    });
  } finally {
    await proxy.close();
  }
  assert.deepEqual(errors, []);
  assert.equal(cuts, 2);
  await checkRead({ seen, streamId, tail, proxy });
});
