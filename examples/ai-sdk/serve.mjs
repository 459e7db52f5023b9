// Bundles app.jsx (esbuild, from node_modules) and serves the page on PORT (default 5173),
// forwarding /v1/ to the broker at BROKER_URL (default http://127.0.0.1:8000): the page and
// its chat API share one origin, as in an app that mounts the chat route next to its pages.
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { build } from "esbuild";

const here = dirname(fileURLToPath(import.meta.url));
const broker = (process.env.BROKER_URL ?? "http://127.0.0.1:8000").replace(/\/$/, "");
const port = Number(process.env.PORT ?? 5173);

const bundle = await build({
  entryPoints: [join(here, "app.jsx")],
  bundle: true,
  format: "esm",
  jsx: "automatic",
  minify: true,
  write: false,
  define: { "process.env.NODE_ENV": '"production"' },
});
const appJs = bundle.outputFiles[0].contents;
const indexHtml = await readFile(join(here, "index.html"));

const FORWARDED = ["content-type", "last-event-id", "authorization"];
// Hop-by-hop, or no longer true once fetch has read the body.
const DROPPED = new Set(["connection", "content-encoding", "content-length", "transfer-encoding"]);

async function forward(request, response) {
  const upstream = new AbortController();
  response.on("close", () => upstream.abort()); // a reload or a closed tab reaches the broker
  const chunks = [];
  for await (const chunk of request) chunks.push(chunk);
  const headers = Object.fromEntries(
    FORWARDED.filter((name) => request.headers[name]).map((name) => [name, request.headers[name]]),
  );
  try {
    const reply = await fetch(broker + request.url, {
      method: request.method,
      headers,
      body: chunks.length ? Buffer.concat(chunks) : undefined,
      signal: upstream.signal,
    });
    const replyHeaders = [...reply.headers].filter(([name]) => !DROPPED.has(name));
    response.writeHead(reply.status, Object.fromEntries(replyHeaders));
    if (reply.body) for await (const chunk of reply.body) response.write(chunk);
    response.end();
  } catch (error) {
    if (!response.headersSent) response.writeHead(502, { "content-type": "text/plain" });
    response.end(upstream.signal.aborted ? undefined : `broker unreachable: ${error.message}`);
  }
}

const server = createServer((request, response) => {
  if (request.url.startsWith("/v1/")) return forward(request, response);
  const path = new URL(request.url, "http://page").pathname;
  if (path === "/app.js") {
    response.writeHead(200, { "content-type": "text/javascript" });
    return response.end(appJs);
  }
  if (path === "/") {
    response.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    return response.end(indexHtml);
  }
  response.writeHead(404).end();
});
server.listen(port, "127.0.0.1", () => {
  console.log(`useChat example on http://127.0.0.1:${server.address().port} (broker ${broker})`);
});
