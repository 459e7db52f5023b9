/** One dispatched server-sent event. `id` is the stream's last event ID at dispatch time. */
export interface ServerSentEvent {
  data: string;
  event: string;
  id: string;
  /** Reconnection time (ms) if this block carried a valid `retry:` field, else null. */
  retry: number | null;
}

/** Incremental `text/event-stream` decoder; does no I/O. */
export class SSEDecoder {
  constructor(options?: { onComment?: (text: string) => void });
  lastEventId: string;
  retry: number | null;
  comments: number;
  /** Consume one chunk and return the events it completed. */
  feed(chunk: string | Uint8Array): ServerSentEvent[];
  /** Signal end of stream: discard an unterminated event; keep `lastEventId` and `retry`. */
  end(): void;
}

export function decodeAll(chunks: Iterable<string | Uint8Array>): ServerSentEvent[];
