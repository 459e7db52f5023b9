// The official suite, run against the broker named by DS_URL (its /ds mount).
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.DS_URL,
  longPollTimeoutMs: Number(process.env.DS_LONG_POLL_MS ?? 500),
  // The reserved subscription APIs (webhook and pull-wake), on when DS_SUBSCRIPTIONS=1.
  subscriptions: process.env.DS_SUBSCRIPTIONS === "1",
})
