// The demo page: one turn at a time, read with the resumable reader of js/client.js.
//
// The turn id, stream id and last offset live in the URL hash, and the rendered turn in
// sessionStorage, so a reload resumes where it was; a second tab opens the same hash without an
// offset and reads the same stream from its start.

import { BrokerClient, TurnState } from "./js/index.js";

const client = new BrokerClient("");
const $ = (id) => document.querySelector(`[data-testid="${id}"]`);

let turnId = null;
let streamId = null;
let state = null; // TurnState of the turn shown
let reading = null; // AbortController of the running read
let drop = null; // cuts the current connection (the reader then reattaches)
let reconnects = 0;
let starting = false;

const newId = () =>
  globalThis.crypto?.randomUUID?.() ?? `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;

function hashParams() {
  return new URLSearchParams(location.hash.slice(1));
}

function keep() {
  // replaceState: keeping the position should not add history entries
  const params = new URLSearchParams({ turn: turnId, stream: streamId });
  if (state?.lastId) params.set("offset", state.lastId);
  history.replaceState(null, "", `#${params}`);
  try {
    sessionStorage.setItem(`turn:${turnId}`, JSON.stringify(state));
  } catch {
    // storage full or disabled: the hash alone still resumes (from the start)
  }
}

function render() {
  const status = state?.status ?? (starting ? "starting" : reading ? "streaming" : state ? "waiting" : "idle");
  const badge = $("status");
  badge.textContent = status;
  badge.dataset.status = status;
  $("prefix").textContent = state?.prefix ?? "";
  $("own").textContent = state?.slot?.text ?? "";
  $("answer").classList.toggle("partial", status === "interrupted");
  $("recovery").hidden = status !== "interrupted" || reading !== null;
  $("stop").disabled = !turnId || state?.status != null;
  $("drop").disabled = drop === null;
  $("reconnects").textContent = String(reconnects);
  $("turn-id").textContent = turnId ?? "none";
  $("attempt").textContent = state?.current != null ? String(state.current) : "–";
  const link = $("second-tab");
  link.hidden = !turnId;
  if (turnId) link.href = `#${new URLSearchParams({ turn: turnId, stream: streamId })}`;
}

function showError(error) {
  $("error").textContent = error ? String(error.message ?? error) : "";
}

/** Read the stream from `offset` until the turn is at rest (or another read replaces this). */
async function follow(offset) {
  reading?.abort();
  const controller = (reading = new AbortController());
  $("offset").textContent = offset;
  render();
  try {
    const events = client.attach(streamId, {
      offset,
      signal: controller.signal,
      onConnect: (cut) => {
        drop = cut;
        render();
      },
      onReconnect: () => {
        reconnects += 1;
        render();
      },
    });
    for await (const event of events) {
      if (state.apply(event)) {
        keep();
        render();
      }
    }
  } catch (error) {
    showError(error);
  } finally {
    if (reading === controller) {
      reading = null;
      drop = null;
      render();
    }
  }
}

function knobs() {
  const simulate = {
    tokens: Number($("knob-tokens").value) || 60,
    tokens_per_s: Number($("knob-pace").value) || 0,
    seed: $("knob-seed").value,
  };
  const breakAfter = $("knob-break").value;
  if (breakAfter !== "") simulate.fail_after_deltas = Number(breakAfter);
  return { simulate };
}

async function send(event) {
  event.preventDefault();
  showError(null);
  reading?.abort();
  turnId = newId();
  state = new TurnState(turnId);
  streamId = null;
  reconnects = 0;
  starting = true;
  render();
  try {
    const turn = await client.startTurn({
      conversationId: `demo-${turnId}`,
      turnId,
      messages: [{ role: "user", content: $("prompt").value }],
      params: knobs(),
    });
    streamId = turn.stream_id;
  } catch (error) {
    showError(error);
    turnId = state = null;
    return;
  } finally {
    starting = false;
    render();
  }
  keep();
  follow("-1");
}

async function retry(strategy) {
  showError(null);
  try {
    await client.retry(turnId, strategy);
  } catch (error) {
    showError(error);
    return;
  }
  follow(state.lastId ?? "-1");
}

async function stop() {
  try {
    await client.cancel(turnId);
  } catch (error) {
    showError(error);
  }
}

function resume() {
  const params = hashParams();
  if (!params.get("turn") || !params.get("stream")) return;
  turnId = params.get("turn");
  streamId = params.get("stream");
  const saved = sessionStorage.getItem(`turn:${turnId}`);
  state = saved ? TurnState.fromJSON(JSON.parse(saved)) : new TurnState(turnId);
  // Only trust an offset that matches the text we kept; otherwise read from the start.
  follow(saved && state.lastId ? state.lastId : "-1");
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", stop);
$("drop").addEventListener("click", () => drop?.());
$("continue").addEventListener("click", () => retry("continue"));
$("regenerate").addEventListener("click", () => retry("regenerate"));
// A second tab opened from the link arrives with a new hash: follow that turn.
window.addEventListener("hashchange", () => {
  const params = hashParams();
  if (params.get("turn") !== turnId) resume();
});
resume();
render();
