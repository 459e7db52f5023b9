// What a page shows for a turn, rebuilt from its events, one slot per (turn, attempt).
//
// Each attempt renders into its own slot. An `attempt` event with strategy "continue" starts its
// slot from the text shown by the attempt before it (the continuation extends it); "initial" and
// "regenerate" start empty (a regeneration replaces it). Deltas go to the slot of the attempt they
// name, so a late event of an old attempt can never append to the new one. The page shows the
// newest attempt's slot.

export class TurnState {
  /** @param {string} turnId */
  constructor(turnId) {
    this.turnId = turnId;
    /** @type {Map<number, {n: number, strategy: string, base: string, text: string,
     *   status: string|null, reason: unknown, usage: unknown, error: unknown, toolCalls: unknown[]}>} */
    this.attempts = new Map();
    this.current = null; // number of the newest attempt
    this.lastId = null; // id of the last event applied
    /** @type {Map<string, {request: object, decision: object|null}>} by approval id */
    this.approvals = new Map();
  }

  /** The tool calls that wait for a person: requests with no decision yet, in their order. */
  get pendingApprovals() {
    return [...this.approvals.values()].filter((a) => a.decision === null).map((a) => a.request);
  }

  /** The newest attempt's slot, or null before any. */
  get slot() {
    return this.current === null ? null : this.attempts.get(this.current) ?? null;
  }

  /** Text to show: the newest attempt's, including what it continues. */
  get text() {
    return this.textOf(this.current);
  }

  /** Text carried over from an earlier attempt (a continued prefix), "" otherwise. */
  get prefix() {
    return this.slot?.base ?? "";
  }

  /**
   * The newest attempt's end status ("complete", "interrupted", "requires_action", ...) or null
   * while it runs.
   */
  get status() {
    return this.slot?.status ?? null;
  }

  textOf(n) {
    const slot = n === null ? undefined : this.attempts.get(n);
    return slot ? slot.base + slot.text : "";
  }

  /**
   * Apply one broker event `{id, type, data, attempt}`; returns false for a replay (an id not
   * above the last one applied), which makes overlapping reads harmless.
   */
  apply(event) {
    if (event.id) {
      if (this.lastId !== null && event.id <= this.lastId) return false;
      this.lastId = event.id;
    }
    const n = event.attempt || event.data?.attempt || 0;
    const data = event.data ?? {};
    if (event.type === "attempt") {
      const base = data.strategy === "continue" ? this.textOf(this.current) : "";
      const slot = this._slot(n);
      Object.assign(slot, { strategy: data.strategy ?? "initial", base, text: "" });
      return true;
    }
    const slot = this._slot(n);
    switch (event.type) {
      case "delta":
        if (typeof data.text === "string") slot.text += data.text;
        break;
      case "tool_call":
      case "tool_result":
        slot.toolCalls.push({ type: event.type, ...data });
        break;
      case "approval_request":
        this.approvals.set(data.approval_id, {
          request: data, decision: this.approvals.get(data.approval_id)?.decision ?? null,
        });
        break;
      case "approval_decision": {
        const known = this.approvals.get(data.approval_id);
        this.approvals.set(data.approval_id, { request: known?.request ?? null, decision: data });
        break;
      }
      case "usage":
        slot.usage = data;
        break;
      case "error":
        slot.error = data;
        break;
      case "end":
        slot.status = typeof data.status === "string" ? data.status : null;
        slot.reason = data.reason ?? null;
        break;
    }
    return true;
  }

  _slot(n) {
    let slot = this.attempts.get(n);
    if (!slot) {
      slot = {
        n, strategy: "initial", base: "", text: "", status: null, reason: null, usage: null,
        error: null, toolCalls: [],
      };
      this.attempts.set(n, slot);
    }
    if (this.current === null || n > this.current) this.current = n;
    return slot;
  }

  /** A plain object to keep (sessionStorage, say); `TurnState.fromJSON` restores it. */
  toJSON() {
    return {
      turnId: this.turnId, current: this.current, lastId: this.lastId,
      attempts: [...this.attempts.values()], approvals: [...this.approvals.values()],
    };
  }

  static fromJSON(json) {
    const state = new TurnState(json.turnId);
    for (const slot of json.attempts ?? []) state.attempts.set(slot.n, { ...slot });
    state.current = json.current ?? null;
    state.lastId = json.lastId ?? null;
    for (const approval of json.approvals ?? []) {
      const id = approval.request?.approval_id ?? approval.decision?.approval_id;
      if (id) state.approvals.set(id, { request: approval.request, decision: approval.decision });
    }
    return state;
  }
}

/** Several turns of a conversation, each in its own slots, in the order they were first seen. */
export class Transcript {
  constructor() {
    /** @type {Map<string, TurnState>} */
    this.turns = new Map();
  }

  /** The state of `turnId`, created empty on first use. */
  turn(turnId) {
    let state = this.turns.get(turnId);
    if (!state) this.turns.set(turnId, (state = new TurnState(turnId)));
    return state;
  }

  /** Apply an event read from `turnId`'s stream. */
  apply(turnId, event) {
    const state = this.turn(turnId);
    state.apply(event);
    return state;
  }
}
