// The broker's browser and Node client: SSE decoder, resumable reader, turn model.
export { SSEDecoder, decodeAll } from "./sse.js";
export {
  BrokerClient, BrokerHTTPError, ProtocolError, ReattachExhausted, DEFAULT_POLICY, EVENT_TYPES,
  attachEventSource, backoffDelay, toBrokerEvent,
} from "./client.js";
export { TurnState, Transcript } from "./turn.js";
