// The official suite, run against the broker named by DS_URL (its /ds mount).
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

runConformanceTests({
  baseUrl: process.env.DS_URL,
  longPollTimeoutMs: Number(process.env.DS_LONG_POLL_MS ?? 500),
})
