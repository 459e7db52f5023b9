// vercel/resumable-stream behind a minimal node:http route, for benchmarks/compare.py only.
//
// Redis: REDIS_URL (the package's own default clients, node-redis). Port: RS_PORT.
//
//   POST /rs/<id>?tokens=N&pace=P[&hold=1][&delay_ms=D]
//                                           start a generation: N deltas at P a second (0: as
//                                           fast as the stream is read), each stamped with its
//                                           emit time (µs since the epoch, then a space), the
//                                           first after D ms; with hold, the stream stays open
//                                           after its last delta until /finish
//                                           (tokens=0&hold=1: a quiet stream)
//   POST /rs/<id>/finish                    end a held stream
//   GET  /rs/<id>/state                     {"written": n, "done": bool}
//   GET  /rs/<id>                           SSE: the stream from the start, or from the
//                                           Last-Event-ID header (an event's id is the count
//                                           of characters up to its end, which the package's
//                                           resume takes as skipCharacters)
//
// The producer runs in this process (the route drains the stream it writes), as a model's
// generation runs in the broker's: what a viewer sees is the package's resume over pub/sub.
import http from "node:http"
import { once } from "node:events"
import { createResumableStreamContext } from "resumable-stream"

const context = createResumableStreamContext({ waitUntil: null })
const generations = new Map() // id -> { written, done, release }
const open = new Set() // SSE responses, for the heartbeat
const HEARTBEAT_MS = Number(process.env.RS_HEARTBEAT_MS ?? 15000)
const TOKENS = [" the", " and", "ing ", " of ", " to ", "tion", " a s", "ment", " in ", " is "]
const ID_DIGITS = 12

const micros = () => Math.round((performance.timeOrigin + performance.now()) * 1000)
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

// One SSE frame; its id is the character offset at its end (fixed width, so it sorts).
function frame(offset, event, data) {
  const tail = `\nevent: ${event}\ndata: ${data}\n\n`
  const end = offset + 4 + ID_DIGITS + tail.length
  return [`id: ${String(end).padStart(ID_DIGITS, "0")}${tail}`, end]
}

function generation(state, tokens, pace, hold, delay) {
  let offset = 0
  let index = 0
  let began = 0
  // Pulled: a delta is made when the package reads the next one, as a model's stream is.
  return () =>
    new ReadableStream({
      async pull(controller) {
        if (index < tokens) {
          if (index === 0) {
            if (delay > 0) await sleep(delay)
            began = performance.now()
          }
          if (pace > 0) {
            const due = began + (index * 1000) / pace
            const wait = due - performance.now()
            if (wait > 0) await sleep(wait)
          } else if (index % 64 === 63) {
            await new Promise((resolve) => setImmediate(resolve))
          }
          const text = `${micros()} ${TOKENS[index % TOKENS.length]}`
          let chunk
          ;[chunk, offset] = frame(offset, "delta", JSON.stringify({ text }))
          index += 1
          state.written = index
          controller.enqueue(chunk)
          return
        }
        if (hold) await state.held
        const [chunk] = frame(offset, "end", '{"status":"complete"}')
        controller.enqueue(chunk)
        controller.close()
      },
    })
}

async function start(id, url, res) {
  const tokens = Number(url.searchParams.get("tokens") ?? 0)
  const pace = Number(url.searchParams.get("pace") ?? 0)
  const hold = url.searchParams.get("hold") === "1"
  const delay = Number(url.searchParams.get("delay_ms") ?? 0)
  const state = { written: 0, done: false }
  state.held = new Promise((resolve) => (state.release = resolve))
  generations.set(id, state)
  const stream = await context.createNewResumableStream(id, generation(state, tokens, pace, hold, delay))
  const reader = stream.getReader()
  ;(async () => {
    while (!(await reader.read()).done);
    state.done = true
  })()
  res.writeHead(201, { "content-type": "application/json" })
  res.end(JSON.stringify({ stream_id: id }))
}

async function view(id, req, res) {
  const skip = Number(req.headers["last-event-id"] ?? 0) || undefined
  let stream
  try {
    stream = await context.resumeExistingStream(id, skip)
  } catch (error) {
    res.writeHead(503, { "content-type": "text/plain" })
    res.end(String(error))
    return
  }
  if (stream === undefined || stream === null) {
    // null: the stream is done, and the package keeps no finished stream to replay.
    res.writeHead(stream === null ? 204 : 404)
    res.end()
    return
  }
  res.writeHead(200, {
    "content-type": "text/event-stream",
    "cache-control": "no-store",
    "x-accel-buffering": "no",
  })
  res.flushHeaders()
  open.add(res)
  const reader = stream.getReader()
  res.on("close", () => {
    open.delete(res)
    reader.cancel().catch(() => {})
  })
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      if (!res.write(value)) await once(res, "drain")
    }
  } catch {
    // the viewer left: the reader was cancelled
  }
  open.delete(res)
  res.end()
}

function answer(res, status, body) {
  res.writeHead(status, { "content-type": "application/json" })
  res.end(JSON.stringify(body))
}

const server = http.createServer(async (req, res) => {
  const url = new URL(req.url, "http://localhost")
  const parts = url.pathname.split("/").filter(Boolean)
  if (parts[0] !== "rs" || parts.length < 2) return answer(res, 404, { error: "not found" })
  const id = parts[1]
  try {
    if (req.method === "POST" && parts.length === 2) return await start(id, url, res)
    if (req.method === "POST" && parts[2] === "finish") {
      generations.get(id)?.release()
      return answer(res, 200, {})
    }
    if (req.method === "GET" && parts[2] === "state") {
      const state = generations.get(id)
      return answer(res, state ? 200 : 404, { written: state?.written ?? 0, done: !!state?.done })
    }
    if (req.method === "GET" && parts.length === 2) return await view(id, req, res)
    return answer(res, 404, { error: "not found" })
  } catch (error) {
    if (!res.headersSent) answer(res, 500, { error: String(error) })
    else res.end()
  }
})

setInterval(() => {
  for (const res of open) res.write(": ping\n\n")
}, HEARTBEAT_MS).unref()

await context.hasExistingStream("warm-up") // the package's Redis clients are connected
server.listen(Number(process.env.RS_PORT), "127.0.0.1", () => {
  console.log(`listening http://127.0.0.1:${server.address().port}`)
})
