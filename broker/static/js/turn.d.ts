import type { ApprovalDecision, ApprovalRequest, BrokerEvent } from "./client.js";

export interface ApprovalState {
  request: ApprovalRequest | null;
  decision: ApprovalDecision | null;
}

export interface AttemptSlot {
  n: number;
  strategy: "initial" | "continue" | "regenerate" | string;
  /** Text carried over from the attempt before (continue), "" otherwise. */
  base: string;
  /** This attempt's own deltas. */
  text: string;
  status: string | null;
  reason: unknown;
  usage: unknown;
  error: unknown;
  toolCalls: unknown[];
}

export class TurnState {
  constructor(turnId: string);
  turnId: string;
  attempts: Map<number, AttemptSlot>;
  current: number | null;
  lastId: string | null;
  /** Every approval the stream showed, by approval id: its request and the decision that stands. */
  approvals: Map<string, ApprovalState>;
  /** The requests with no decision yet (the calls that wait for a person). */
  readonly pendingApprovals: ApprovalRequest[];
  readonly slot: AttemptSlot | null;
  readonly text: string;
  readonly prefix: string;
  readonly status: string | null;
  textOf(n: number | null): string;
  apply(event: BrokerEvent): boolean;
  toJSON(): {
    turnId: string; current: number | null; lastId: string | null; attempts: AttemptSlot[];
    approvals: ApprovalState[];
  };
  static fromJSON(json: ReturnType<TurnState["toJSON"]>): TurnState;
}

export class Transcript {
  turns: Map<string, TurnState>;
  turn(turnId: string): TurnState;
  apply(turnId: string, event: BrokerEvent): TurnState;
}
