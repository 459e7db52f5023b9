// The official Durable Streams client follows a generation's stream live, is cut after its first
// batch of at least CUT messages, and resumes from the offset it saved, to the stream's close.
// Prints {"first": [ids...], "second": [ids...], "closed": bool} as one line of JSON.
import { stream } from "@durable-streams/client"

const url = process.env.DS_STREAM_URL
const live = process.env.DS_LIVE === "sse" ? "sse" : "long-poll"
const cut = Number(process.env.DS_CUT ?? 3)
const headers = process.env.DS_TOKEN ? { Authorization: `Bearer ${process.env.DS_TOKEN}` } : {}

function follow(offset, enough) {
  return new Promise((resolve, reject) => {
    const ids = []
    stream({ url, offset, live, headers })
      .then((res) => {
        const stop = res.subscribeJson(async (batch) => {
          for (const item of batch.items) ids.push(item.id)
          if (batch.streamClosed || enough(ids)) {
            stop()
            res.cancel()
            resolve({ ids, offset: batch.offset, closed: Boolean(batch.streamClosed) })
          }
        })
      })
      .catch(reject)
  })
}

const first = await follow("-1", (ids) => ids.length >= cut)
const second = first.closed ? { ids: [], closed: true } : await follow(first.offset, () => false)
console.log(JSON.stringify({ first: first.ids, second: second.ids, closed: second.closed }))
