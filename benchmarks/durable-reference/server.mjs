// The reference server (in memory), on DS_PORT, for benchmarks/durable.py.
import { DurableStreamTestServer } from "@durable-streams/server"

const server = new DurableStreamTestServer({
  port: Number(process.env.DS_PORT),
  host: "127.0.0.1",
  longPollTimeout: 500,
})
await server.start()
console.log(`listening ${server.url}`)
