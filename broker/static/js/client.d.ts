/** One event of a broker stream. */
export interface BrokerEvent {
  id: string;
  type:
    | "attempt" | "delta" | "tool_call" | "tool_result" | "approval_request" | "approval_decision"
    | "usage" | "error" | "end" | string;
  data: any;
  /** Attempt number the event belongs to (0 when it names none). */
  attempt: number;
}

export interface AttachPolicy {
  /** Consecutive failed connections before giving up (default 8). */
  maxRetries: number;
  /** Backoff base in ms when the server sent no `retry:` (default 500). */
  baseDelay: number;
  /** Backoff cap in ms (default 15000). */
  maxDelay: number;
  /** Silence in ms after which a connection counts as dead (default 45000). */
  readTimeout: number;
  /** A longer `Retry-After` (ms) ends `attach` with that error instead of waiting (default 60000). */
  maxRetryAfter: number;
  /** Jitter source in [0, 1) (default Math.random). */
  random: () => number;
}

export interface AttachStats {
  reconnects: number;
  failures: number;
  events: number;
  duplicates: number;
  heartbeats: number;
  lastEventId: string | null;
  lastError?: unknown;
}

export interface ReconnectInfo {
  failures: number;
  delay: number;
  error: unknown;
  lastEventId: string | null;
}

export interface AttachOptions {
  /** Where to start when nothing was read yet: "-1" (the start, default), "now" or an event id. */
  offset?: string;
  /** An attach token, sent as `?token=` instead of the client's API key. */
  token?: string;
  signal?: AbortSignal;
  policy?: Partial<AttachPolicy>;
  stats?: Partial<AttachStats>;
  onReconnect?: (info: ReconnectInfo) => void;
  /** Called for each connection with a function that cuts that connection only. */
  onConnect?: (drop: () => void) => void;
}

export interface StartTurnOptions {
  conversationId: string;
  messages: Array<{ role: string; content: unknown; [key: string]: unknown }>;
  turnId?: string;
  provider?: string;
  model?: string;
  params?: Record<string, unknown>;
  tools?: Array<Record<string, unknown>>;
  /** Tools the client runs: `{name, description?, parameters?}`; their calls end the turn
   * `requires_action`. */
  clientTools?: Array<{ name: string; description?: string; parameters?: Record<string, unknown> }>;
  // "text", "json", or { type: "json_schema", name, schema, strict?, description? }
  responseFormat?: "text" | "json" | Record<string, unknown>;
}

export interface TurnInfo {
  turn_id: string;
  conversation_id: string;
  stream_id: string;
  status: string;
  attempt: number;
  links: Record<string, string>;
  [key: string]: unknown;
}

export interface AttachTokenOptions {
  /** Lifetime in seconds (default: the broker's BROKER_ATTACH_TOKEN_TTL, capped by its maximum). */
  ttlS?: number;
  /** Admit one SSE connection at a time (a newer one takes over; the older gets `replaced`). */
  oneViewer?: boolean;
  /** The approve scope: the token may also decide the turn's tool approvals. */
  approve?: boolean;
}

/** The decision that stands on an approval (an `approval_decision` event's fields). */
export interface ApprovalDecision {
  approval_id: string;
  decision: "approve" | "deny";
  reason: string | null;
  /** `person`, `expiry` (deny, reason `expired`) or `stop`. */
  by: "person" | "expiry" | "stop" | string;
}

/** A tool call that waits for a person (an `approval_request` event's fields). */
export interface ApprovalRequest {
  approval_id: string;
  call_id: string;
  name: string;
  ordinal: number;
  args: unknown;
  /** Seconds since the epoch: then it is denied (reason `expired`). */
  expires_at: number;
  attempt?: number;
}

export interface AttachTokenInfo {
  /** The read-only credential: pass it as `token` to `attach`, `catchUp` or `streamUrl`. */
  token: string;
  turn_id: string;
  stream_id: string;
  /** Unix seconds. */
  expires_at: number;
  one_viewer: boolean;
  links: { stream: string; [key: string]: string };
  /** `links.stream` made absolute against the client's base URL (relative when that is ""). */
  streamUrl: string;
  [key: string]: unknown;
}

export interface BrokerClientOptions {
  fetch?: typeof fetch;
  headers?: Record<string, string>;
  policy?: Partial<AttachPolicy>;
  /** An API key, a JWT or an attach token, sent as `Authorization: Bearer ...` on every call. */
  apiKey?: string | null;
}

export const EVENT_TYPES: readonly string[];
export const DEFAULT_POLICY: Readonly<AttachPolicy>;

export class BrokerHTTPError extends Error {
  constructor(status: number, body: unknown, retryAfter?: number | null);
  status: number;
  /** The broker's error code: `bad_credentials`, `token_expired`, `read_only`, `rate_limited`, ... */
  code: string | null;
  body: unknown;
  /** Seconds of the answer's `Retry-After` header (429, 503), or null. */
  retryAfter: number | null;
}
export class ReattachExhausted extends Error {
  failures: number;
}
export class ProtocolError extends Error {}

export function backoffDelay(
  failures: number, base: number, cap: number, rand?: () => number,
): number;

export function toBrokerEvent(sse: { id: string; event: string; data: string }): BrokerEvent;

export class BrokerClient {
  constructor(baseUrl?: string, options?: BrokerClientOptions);
  baseUrl: string;
  headers: Record<string, string>;
  policy: AttachPolicy;
  /** Sent as `Authorization: Bearer ...`; may be set or cleared at any time. */
  apiKey: string | null;
  startTurn(options: StartTurnOptions): Promise<TurnInfo & { created: boolean }>;
  getTurn(turnId: string): Promise<Record<string, any>>;
  cancel(turnId: string): Promise<Record<string, any>>;
  retry(turnId: string, strategy: "continue" | "regenerate"): Promise<Record<string, any>>;
  mintAttachToken(turnId: string, options?: AttachTokenOptions): Promise<AttachTokenInfo>;
  /** Approve a tool call that waits for a person; the decision that stands is returned. */
  approve(turnId: string, approvalId: string, options?: { token?: string }): Promise<ApprovalDecision>;
  /** Deny a tool call that waits for a person (the model is told `reason`). */
  deny(
    turnId: string, approvalId: string, options?: { reason?: string; token?: string },
  ): Promise<ApprovalDecision>;
  /** The first decision wins: the one that stands is returned (a 409 is not thrown). */
  decide(
    turnId: string, approvalId: string, decision: "approve" | "deny",
    options?: { reason?: string; token?: string },
  ): Promise<ApprovalDecision>;
  catchUp(streamId: string, offset?: string, options?: { token?: string }): Promise<{
    events: Array<Record<string, any>>; next_offset: string; up_to_date: boolean; closed: boolean;
  }>;
  /** The SSE URL of a stream, with `offset` and an attach `token` in the query. */
  streamUrl(streamId: string, offset?: string | null, token?: string | null): string;
  attach(streamId: string, options?: AttachOptions): AsyncGenerator<BrokerEvent, void, undefined>;
}

export interface EventSourceHandle {
  source: EventSource;
  lastEventId: string | null;
  close(): void;
}

export function attachEventSource(
  url: string,
  options?: {
    onEvent?: (event: BrokerEvent) => void;
    /** Called once: with the `end` event, or null when the source closed without one. */
    onEnd?: (event: BrokerEvent | null) => void;
    onError?: (error: Event) => void;
    signal?: AbortSignal;
    /** An attach token, added to the URL as `?token=` (EventSource sends no headers). */
    token?: string | null;
    EventSource?: typeof EventSource;
  },
): EventSourceHandle;
