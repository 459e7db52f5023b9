// The project's own JS client (broker/static/js): `attach` reattaches by itself with
// Last-Event-ID and yields each event once, its data parsed.
import assert from "node:assert/strict";
import { test } from "node:test";
import { BrokerClient } from "../../../../broker/static/js/index.js";
import { checkRead, cutProxy, liveTurn, waitFor } from "./support.js";

test("the JS client reads across two cuts without a gap, a repeat or a parse error", {
  timeout: 30_000,
}, async () => {
  const { streamId, tail } = await liveTurn("js-client");
  const proxy = await cutProxy();
  const client = new BrokerClient(proxy.url, { policy: { baseDelay: 50, maxDelay: 200 } });
  const stats = {};
  const seen = [];
  let cuts = 0;
  // The client keeps its resume point to itself: cut once it has one.
  const first = waitFor(() => stats.lastEventId, "a resume point").then(() => {
    cuts = 1;
    proxy.cut({ reset: true });
  });
  try {
    for await (const event of client.attach(streamId, { offset: "now", stats })) {
      seen.push([event.type, event.id, event.data]);
      if (cuts === 1 && seen.length >= 5) {
        cuts = 2;
        proxy.cut({ reset: false });
      }
    }
    await first;
  } finally {
    await proxy.close();
  }
  assert.equal(cuts, 2);
  assert.equal(stats.duplicates, 0);
  assert.ok(stats.reconnects >= 2, `${stats.reconnects} reconnects`);
  await checkRead({ seen, streamId, tail, proxy, resumePoint: false });
});
