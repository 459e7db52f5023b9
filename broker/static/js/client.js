// Fetch-based client for the broker: start turns, stop and retry them, follow their streams.
//
// `attach` is the resumable reader: it reconnects with `Last-Event-ID` after any failure, with
// full-jitter backoff based on the server's `retry:` field, and stops once the turn is at rest
// (a clean close right after an `end` event, or a 204 answer). The SSE parsing lives in sse.js.
//
// Credentials: `apiKey` goes out as `Authorization: Bearer ...` on every fetch; a stream read may
// use an attach token instead (`token`), sent as `?token=` so that EventSource can use it too.

import { SSEDecoder } from "./sse.js";

/** Event types the broker sends on a stream. */
export const EVENT_TYPES = Object.freeze([
  "attempt", "delta", "tool_input_delta", "tool_call", "tool_result", "approval_request",
  "approval_decision", "usage", "error", "end",
]);

// The event whose id is where a read from `now` starts (its data repeats it as `offset`).
const RESUME_POINT = "resume_point";

/** Defaults for `attach`; times in milliseconds. */
export const DEFAULT_POLICY = Object.freeze({
  maxRetries: 8, // consecutive failed connections before giving up
  baseDelay: 500, // backoff base when the server sent no `retry:`
  maxDelay: 15000, // backoff cap
  readTimeout: 45000, // silence (no bytes, not even a heartbeat) that counts as a dead connection
  maxRetryAfter: 60000, // a longer Retry-After ends `attach` with that error instead of waiting
  random: Math.random, // jitter source, replaceable in tests
});

// Statuses describing a passing condition (restart, overload), worth waiting out. 401 and 403
// are never among them: refused credentials do not get better by asking again.
const RETRYABLE = new Set([408, 425, 429]);
const isRetryable = (status) => status >= 500 || RETRYABLE.has(status);

/** Seconds from a `Retry-After` header (delta-seconds or an HTTP date); null if unusable. */
function parseRetryAfter(value) {
  if (value == null || String(value).trim() === "") return null;
  const text = String(value).trim();
  let seconds = /^[+-]?(\d+\.?\d*|\.\d+)$/.test(text) ? Number(text) : NaN;
  if (Number.isNaN(seconds)) {
    const when = Date.parse(text);
    if (Number.isNaN(when)) return null;
    seconds = (when - Date.now()) / 1000;
  }
  return Number.isFinite(seconds) ? Math.max(0, seconds) : null;
}

/**
 * An error answer from the broker; `code` is the broker's error code when it sent one
 * (`bad_credentials`, `token_expired`, `read_only`, `token_in_use`, `rate_limited`, ...), and
 * `retryAfter` the seconds of a `Retry-After` header (null without one).
 */
export class BrokerHTTPError extends Error {
  constructor(status, body, retryAfter = null) {
    const error = body && typeof body === "object" ? body.error ?? body : null;
    const message = (error && error.message) || (typeof body === "string" && body) || "";
    super(`HTTP ${status}${message ? `: ${message}` : ""}`);
    this.name = "BrokerHTTPError";
    this.status = status;
    this.code = (error && error.code) || null;
    this.body = body;
    this.retryAfter = retryAfter;
  }
}

async function httpError(response) {
  const body = await readBody(response);
  return new BrokerHTTPError(
    response.status, body, parseRetryAfter(response.headers?.get?.("retry-after")),
  );
}

/** `attach` gave up after too many consecutive failed connections. */
export class ReattachExhausted extends Error {
  constructor(failures, cause) {
    super(`gave up after ${failures} consecutive failed connections: ${cause}`, { cause });
    this.name = "ReattachExhausted";
    this.failures = failures;
  }
}

/** The response was not an event stream (a proxy's error page, say). */
export class ProtocolError extends Error {
  constructor(message) {
    super(message);
    this.name = "ProtocolError";
  }
}

/**
 * Full-jitter delay (ms) before the reconnect that follows the `failures`-th consecutive failure:
 * uniform(0, min(cap, base * 2^(failures-1))).
 */
export function backoffDelay(failures, base, cap, rand = Math.random) {
  const exponent = Math.min(Math.max(failures - 1, 0), 60); // past 60 doublings any cap is reached
  return rand() * Math.min(cap, base * 2 ** exponent);
}

/** Parse one SSE event of the broker into `{id, type, data, attempt}`. */
export function toBrokerEvent(sse) {
  let data;
  try {
    data = JSON.parse(sse.data);
  } catch {
    throw new ProtocolError(`event ${sse.id} carries data that is not JSON`);
  }
  const attempt = data && Number.isInteger(data.attempt) ? data.attempt : 0;
  return { id: sse.id, type: sse.event, data, attempt };
}

function sleep(ms, signal) {
  // Resolves true when `signal` aborted the wait, false when the time passed.
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve(true);
    const done = (aborted) => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
      resolve(aborted);
    };
    const onAbort = () => done(true);
    const timer = setTimeout(() => done(false), ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

async function readBody(response) {
  const text = await response.text().catch(() => "");
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

const enc = encodeURIComponent;

const withQuery = (url, params) => {
  const query = Object.entries(params)
    .filter(([, value]) => value != null)
    .map(([key, value]) => `${key}=${enc(value)}`)
    .join("&");
  return query ? `${url}${url.includes("?") ? "&" : "?"}${query}` : url;
};

export class BrokerClient {
  /**
   * @param {string} [baseUrl] the broker's origin; "" means the page's own origin
   * @param {{fetch?: typeof fetch, headers?: Record<string, string>, policy?: object,
   *   apiKey?: string | null}} [options] `apiKey` (an API key, a JWT or an attach token) is sent
   *   as `Authorization: Bearer ...` on every call; it may be changed later on the instance.
   */
  constructor(baseUrl = "", { fetch: fetchImpl, headers = {}, policy = {}, apiKey = null } = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.headers = { ...headers };
    this.policy = { ...DEFAULT_POLICY, ...policy };
    this.apiKey = apiKey || null;
    this._fetch = fetchImpl ?? ((...args) => globalThis.fetch(...args));
  }

  // The credential of one call: an attach token travels alone in the query (the broker prefers
  // it anyway, and the key has no business going along); otherwise the API key, if any.
  _auth(token) {
    return token == null && this.apiKey ? { Authorization: `Bearer ${this.apiKey}` } : {};
  }

  /** Start a turn (POST /v1/turns). With a `turnId` it is idempotent: `created` tells. */
  async startTurn({
    conversationId, messages, turnId, provider, model, params, tools, clientTools, responseFormat,
  }) {
    const body = { conversation_id: conversationId, messages };
    const optional = {
      turn_id: turnId, provider, model, params, tools, client_tools: clientTools,
      response_format: responseFormat,
    };
    for (const [key, value] of Object.entries(optional)) if (value != null) body[key] = value;
    const { data, status } = await this._json("POST", "/v1/turns", body);
    return { ...data, created: status === 201 };
  }

  /** A turn's state: status, attempts, canonical text (GET /v1/turns/{id}). */
  async getTurn(turnId) {
    return (await this._json("GET", `/v1/turns/${enc(turnId)}`)).data;
  }

  /** Stop a running turn; the text so far stays (POST /v1/turns/{id}/cancel). */
  async cancel(turnId) {
    return (await this._json("POST", `/v1/turns/${enc(turnId)}/cancel`)).data;
  }

  /** Start a new attempt of an interrupted turn: "continue" extends, "regenerate" replaces. */
  async retry(turnId, strategy) {
    if (strategy !== "continue" && strategy !== "regenerate") {
      throw new TypeError(`strategy must be "continue" or "regenerate", not ${strategy}`);
    }
    return (await this._json("POST", `/v1/turns/${enc(turnId)}/attempts`, { strategy })).data;
  }

  /**
   * Mint a read-only attach token for a turn's stream (POST /v1/turns/{id}/attach-tokens).
   * Returns the broker's answer plus `streamUrl`, the absolute stream URL with `?token=`.
   */
  async mintAttachToken(turnId, { ttlS, oneViewer = false, approve = false } = {}) {
    const body = { one_viewer: Boolean(oneViewer) };
    if (approve) body.approve = true; // the token may also decide the turn's approvals
    if (ttlS != null) body.ttl_s = ttlS;
    const path = `/v1/turns/${enc(turnId)}/attach-tokens`;
    const { data } = await this._json("POST", path, body);
    const link = data?.links?.stream ?? this.streamUrl(data.stream_id, null, data.token);
    return { ...data, streamUrl: /^[a-z]+:\/\//i.test(link) ? link : this.baseUrl + link };
  }

  /** Approve a tool call that waits for a person; see `decide`. */
  async approve(turnId, approvalId, { token } = {}) {
    return this.decide(turnId, approvalId, "approve", { token });
  }

  /** Deny a tool call that waits for a person (the model is told `reason`); see `decide`. */
  async deny(turnId, approvalId, { reason, token } = {}) {
    return this.decide(turnId, approvalId, "deny", { reason, token });
  }

  /**
   * Decide an approval (POST /v1/turns/{id}/approvals/{approval_id}): the first decision wins,
   * and the one that stands is returned, `{approval_id, decision, reason, by}` (compare its
   * `decision` with yours: another device, or the expiry, may have decided first). `token`: an
   * attach token minted with `approve: true`, sent as `?token=` instead of the API key.
   */
  async decide(turnId, approvalId, decision, { reason, token } = {}) {
    if (decision !== "approve" && decision !== "deny") {
      throw new TypeError(`decision must be "approve" or "deny", not ${decision}`);
    }
    const body = { decision };
    if (reason != null) body.reason = reason;
    const path = withQuery(`/v1/turns/${enc(turnId)}/approvals/${enc(approvalId)}`, { token });
    try {
      return (await this._json("POST", path, body, token)).data;
    } catch (error) {
      // Another decision stands (409 approval_decided): the body names it.
      if (error instanceof BrokerHTTPError && error.status === 409 && error.body?.decision) {
        const { approval_id, decision: standing, reason: why = null, by } = error.body;
        return { approval_id, decision: standing, reason: why, by };
      }
      throw error;
    }
  }

  /** One JSON page of events after `offset`, for clients that poll; `token`: an attach token. */
  async catchUp(streamId, offset = "-1", { token } = {}) {
    const path = withQuery(`/v1/streams/${enc(streamId)}`, { format: "json", offset, token });
    return (await this._json("GET", path, undefined, token)).data;
  }

  /**
   * The SSE URL of a stream. `offset` and `token` (an attach token) go in the query, for
   * EventSource, which sets no headers.
   */
  streamUrl(streamId, offset, token) {
    return withQuery(`${this.baseUrl}/v1/streams/${enc(streamId)}`, { offset, token });
  }

  /**
   * Follow a stream from `offset` until the turn is at rest, reconnecting as needed.
   * Yields `{id, type, data, attempt}` once each, in id order. Returns when a response closes
   * cleanly after an `end` event, on a 204, or when `signal` aborts. Throws BrokerHTTPError on a
   * non-retryable status (400, 401, 403, 404, 410; 409 `token_in_use` from older brokers on the
   * first connection, waited out on a reconnect), or a 409 `viewer_replaced` when a newer
   * connection of the same one-viewer token took it over (its `replaced` event), and
   * ReattachExhausted after too many failures in a row. A `Retry-After` (429, 503) is waited out
   * (a 429 without one waits at least the base delay); one beyond `policy.maxRetryAfter` throws.
   * `token` (an attach token) is sent as `?token=` instead of the API key.
   *
   * `onConnect(drop)` is called for each connection with a function that cuts that connection
   * only (a simulated network failure: the reader reattaches). `stats` is updated in place.
   */
  async *attach(streamId, options = {}) {
    const { offset = "-1", signal, onReconnect, onConnect, token } = options;
    const policy = { ...this.policy, ...options.policy };
    const stats = Object.assign(options.stats ?? {}, {
      reconnects: 0, failures: 0, events: 0, duplicates: 0, heartbeats: 0, lastEventId: null,
    });
    const url = `${this.baseUrl}/v1/streams/${enc(streamId)}`;
    let lastId = null;
    let lastType = null;
    let retryBase = null;
    let connected = false;
    const advance = (id) => {
      lastId = stats.lastEventId = id;
      stats.failures = 0; // progress: the broker is up and serving this stream
    };

    for (;;) {
      if (signal?.aborted) return;
      const conn = new AbortController();
      const onAbort = () => conn.abort(signal.reason);
      signal?.addEventListener("abort", onAbort, { once: true });
      onConnect?.(() => conn.abort(new DOMException("connection dropped", "AbortError")));
      let failure;
      let leastWait = 0;
      try {
        const headers = { ...this.headers, ...this._auth(token), Accept: "text/event-stream" };
        let query = offset;
        if (lastId !== null) {
          // The broker prefers Last-Event-ID; the query says the same to anything that only
          // reads the URL.
          query = headers["Last-Event-ID"] = lastId;
        }
        const response = await this._fetch(withQuery(url, { offset: query, token }), {
          headers, signal: conn.signal, cache: "no-store",
        });
        if (response.status === 204) return; // at rest, nothing after our position
        if (response.status !== 200) {
          const error = await httpError(response);
          // A one-viewer token's lock outlives a cut connection by a moment (until the broker
          // notices the disconnect): after our own drop, that 409 is waited out.
          const lingering = connected && error.status === 409 && error.code === "token_in_use";
          if (!isRetryable(error.status) && !lingering) throw error;
          const floor = error.status === 429 || lingering
            ? Math.max(retryBase ?? 0, policy.baseDelay) : 0;
          leastWait = error.retryAfter != null ? error.retryAfter * 1000 : floor;
          if (leastWait > policy.maxRetryAfter) throw error;
          failure = error;
        } else {
          connected = true;
          const type = (response.headers.get("content-type") ?? "").split(";")[0].trim();
          if (type.toLowerCase() !== "text/event-stream") {
            throw new ProtocolError(`expected text/event-stream, got ${type || "nothing"}`);
          }
          const decoder = new SSEDecoder();
          const reader = response.body.getReader();
          let timer;
          const arm = () => {
            clearTimeout(timer);
            timer = setTimeout(
              () => conn.abort(new DOMException("read timeout", "TimeoutError")),
              policy.readTimeout,
            );
          };
          try {
            arm();
            for (;;) {
              const { value, done } = await reader.read();
              if (done) break;
              arm();
              for (const sse of decoder.feed(value)) {
                if (sse.event === "replaced") {
                  // A newer connection of our one-viewer token took over: reconnecting would
                  // only take it back.
                  let reason = null;
                  try { reason = JSON.parse(sse.data); } catch { /* keep the default */ }
                  throw new BrokerHTTPError(409, { error: reason ?? { code: "viewer_replaced" } });
                }
                if (sse.event === RESUME_POINT) {
                  // Where a read from `now` starts: the resume point, not an event.
                  if (lastId === null || sse.id > lastId) advance(sse.id);
                  continue;
                }
                if (lastId !== null && sse.id <= lastId) {
                  stats.duplicates += 1; // a replay overlapping what was already yielded
                  continue;
                }
                const event = toBrokerEvent(sse);
                advance(event.id);
                lastType = event.type;
                stats.events += 1;
                yield event;
                if (signal?.aborted) return;
              }
              // An id-only block (older brokers' resume point) moves it without being an event.
              const id = decoder.lastEventId;
              if (id && (lastId === null || id > lastId)) advance(id);
              if (decoder.retry !== null) retryBase = decoder.retry;
              if (decoder.comments) {
                stats.heartbeats += decoder.comments;
                decoder.comments = 0;
                stats.failures = 0;
              }
            }
          } finally {
            clearTimeout(timer);
            reader.cancel().catch(() => {});
          }
          if (lastType === "end") return;
          failure = new Error("the response ended before the turn did");
        }
      } catch (error) {
        if (signal?.aborted) return;
        if (error instanceof BrokerHTTPError || error instanceof ProtocolError) throw error;
        failure = error; // network error, dropped connection, read timeout
      } finally {
        signal?.removeEventListener("abort", onAbort);
        conn.abort(); // release the connection whatever happened
      }

      stats.failures += 1;
      stats.lastError = failure;
      if (stats.failures > policy.maxRetries) throw new ReattachExhausted(stats.failures, failure);
      const base = retryBase ?? policy.baseDelay;
      const delay = Math.max(
        backoffDelay(stats.failures, base, policy.maxDelay, policy.random), leastWait,
      );
      stats.reconnects += 1;
      onReconnect?.({ failures: stats.failures, delay, error: failure, lastEventId: lastId });
      if (await sleep(delay, signal)) return;
    }
  }

  async _json(method, path, body, token) {
    const headers = { ...this.headers, ...this._auth(token), Accept: "application/json" };
    const init = { method, headers };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await this._fetch(this.baseUrl + path, init);
    if (response.status >= 400) throw await httpError(response);
    return { data: await readBody(response), status: response.status };
  }
}

/**
 * Follow a stream with the browser's native EventSource, for pages that need no custom headers.
 * EventSource resends Last-Event-ID on its own reconnects; this closes it after an `end` event
 * (the turn is at rest) or when `signal` aborts, and drops replays of events already delivered.
 * To follow a later attempt, call again with `offset` set to the last id seen. `token` (an attach
 * token) is added to the URL as `?token=`: EventSource cannot send an Authorization header. A
 * refused token (401, 403) makes the browser close the source for good: `onEnd(null)` follows.
 */
export function attachEventSource(
  url, { onEvent, onEnd, onError, signal, token, EventSource: ES } = {},
) {
  const Impl = ES ?? globalThis.EventSource;
  const source = new Impl(token != null ? withQuery(url, { token }) : url);
  const handle = {
    source,
    lastEventId: null,
    close() {
      source.close();
    },
  };
  let ended = false;
  const finish = (event) => {
    if (ended) return;
    ended = true;
    source.close();
    onEnd?.(event);
  };
  const listener = (message) => {
    // EventSource's own `error` event (a lost connection) shares the broker's `error` event's
    // name: only a message is one of the stream's events.
    if (typeof message.data !== "string") return;
    const id = message.lastEventId;
    if (handle.lastEventId !== null && id && id <= handle.lastEventId) return;
    if (id) handle.lastEventId = id;
    const event = toBrokerEvent({ id, event: message.type, data: message.data });
    onEvent?.(event);
    if (event.type === "end") finish(event);
  };
  for (const type of EVENT_TYPES) source.addEventListener(type, listener);
  source.addEventListener(RESUME_POINT, (message) => {
    // The browser keeps it as its Last-Event-ID by itself; the handle says it too.
    const id = message.lastEventId;
    if (id && (handle.lastEventId === null || id > handle.lastEventId)) handle.lastEventId = id;
  });
  source.addEventListener("error", (error) => {
    // CLOSED after an error: the browser gave up (a 204 at rest, or a fatal status).
    if (source.readyState === 2) finish(null);
    else onError?.(error);
  });
  signal?.addEventListener("abort", () => finish(null), { once: true });
  return handle;
}
