export * from "./sse.js";
export * from "./client.js";
export * from "./turn.js";
