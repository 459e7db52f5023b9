// Incremental decoder for `text/event-stream` (WHATWG HTML, "Server-sent events").
//
// No I/O: feed it chunks as they arrive (strings or bytes) and it returns the events they
// complete. Chunks may be split anywhere, including inside a UTF-8 sequence or between CR and LF.

const EOL = /\r\n|\r|\n/g;
const DIGITS = /^[0-9]+$/;

export class SSEDecoder {
  /** @param {{onComment?: (text: string) => void}} [options] */
  constructor({ onComment } = {}) {
    /** The stream's last event ID; updated by every block that ends, even one without data. */
    this.lastEventId = "";
    /** Latest valid `retry:` value in milliseconds, or null. */
    this.retry = null;
    /** Number of comment lines seen (heartbeats). */
    this.comments = 0;
    this._onComment = onComment;
    this._utf8 = new TextDecoder("utf-8", { ignoreBOM: true });
    this._buffer = "";
    this._atStart = true;
    // A chunk that ends in CR cannot tell yet whether an LF follows: the line ends at the CR and
    // a leading LF of the next chunk is then swallowed.
    this._skipLF = false;
    this._data = [];
    this._type = "";
    this._idBuffer = "";
    this._blockRetry = null;
  }

  /**
   * Consume one chunk; return the events it completed, possibly none.
   * @param {string | Uint8Array} chunk
   */
  feed(chunk) {
    const text = typeof chunk === "string" ? chunk : this._utf8.decode(chunk, { stream: true });
    return this._consume(text);
  }

  /** End of stream: drop an unterminated event (as the spec says); keep lastEventId and retry. */
  end() {
    this._utf8 = new TextDecoder("utf-8", { ignoreBOM: true });
    this._buffer = "";
    this._atStart = true;
    this._skipLF = false;
    this._idBuffer = this.lastEventId; // an id from a block that never ended was never committed
    this._resetBlock();
  }

  _consume(text) {
    if (!text) return [];
    if (this._atStart) {
      this._atStart = false;
      if (text[0] === "\ufeff") text = text.slice(1);
    }
    if (this._skipLF && text) {
      this._skipLF = false;
      if (text[0] === "\n") text = text.slice(1);
    }
    const buffer = this._buffer + text;
    const events = [];
    let pos = 0;
    EOL.lastIndex = 0;
    for (let m; (m = EOL.exec(buffer)) !== null; ) {
      if (m[0] === "\r" && EOL.lastIndex === buffer.length) this._skipLF = true;
      const event = this._line(buffer.slice(pos, m.index));
      if (event) events.push(event);
      pos = EOL.lastIndex;
    }
    this._buffer = buffer.slice(pos);
    return events;
  }

  _line(line) {
    if (line === "") return this._dispatch();
    if (line[0] === ":") {
      this.comments += 1;
      if (this._onComment) {
        const c = line.slice(1);
        this._onComment(c.startsWith(" ") ? c.slice(1) : c);
      }
      return null;
    }
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") this._data.push(value);
    else if (name === "event") this._type = value;
    else if (name === "id") {
      if (!value.includes("\0")) this._idBuffer = value;
    } else if (name === "retry" && DIGITS.test(value)) {
      this.retry = Number(value);
      this._blockRetry = this.retry;
    }
    return null;
  }

  _dispatch() {
    this.lastEventId = this._idBuffer;
    if (this._data.length === 0) {
      this._resetBlock();
      return null;
    }
    const event = {
      data: this._data.join("\n"),
      event: this._type || "message",
      id: this.lastEventId,
      retry: this._blockRetry,
    };
    this._resetBlock();
    return event;
  }

  _resetBlock() {
    this._data = [];
    this._type = "";
    this._blockRetry = null;
  }
}

/**
 * Decode a complete stream given as chunks; handy for tests and recorded streams.
 * @param {Iterable<string | Uint8Array>} chunks
 */
export function decodeAll(chunks) {
  const decoder = new SSEDecoder();
  const events = [];
  for (const chunk of chunks) events.push(...decoder.feed(chunk));
  return events;
}
