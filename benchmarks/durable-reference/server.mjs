// The reference server (in memory), on DS_PORT, for benchmarks/durable.py and compare.py.
// DS_LONG_POLL_MS: how long a live read waits before a keep-alive (default 500 ms).
import { DurableStreamTestServer } from "@durable-streams/server"

const server = new DurableStreamTestServer({
  port: Number(process.env.DS_PORT),
  host: "127.0.0.1",
  longPollTimeout: Number(process.env.DS_LONG_POLL_MS ?? 500),
})
await server.start()
console.log(`listening ${server.url}`)
