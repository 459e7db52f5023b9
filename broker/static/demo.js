// The demo page: one turn at a time, read with the resumable reader of js/client.js.
//
// The turn id, stream id and last offset live in the URL hash, and the rendered turn in
// sessionStorage, so a reload resumes where it was; a second tab opens the same hash without an
// offset and reads the same stream from its start.
//
// A tool whose rule asks a person (docs/tools.md, Approvals) shows its call with Allow and Deny
// in every tab that follows the turn: the first decision wins, and every tab sees it.
//
// A broker with API keys answers 401: the page then asks for a key, keeps it in sessionStorage
// (this tab only) and sends it on every call. "Share read-only link" mints an attach token for
// the turn; the link carries it in the hash (never sent to a server, never in a Referer), and a
// page opened on it is a viewer: it follows that one stream with the token and can do nothing
// else.

import { BrokerClient, TurnState } from "./js/index.js";

const KEY_STORAGE = "broker:api-key";
const SHARE_TTL_S = 3600;

function storedKey() {
  try {
    return sessionStorage.getItem(KEY_STORAGE);
  } catch {
    return null; // storage disabled: the key lives as long as the page
  }
}

const client = new BrokerClient("", { apiKey: storedKey() });
const $ = (id) => document.querySelector(`[data-testid="${id}"]`);

let token = null; // viewer mode: the attach token this page reads with
let sharing = false;
let turnId = null;
let streamId = null;
let state = null; // TurnState of the turn shown
let reading = null; // AbortController of the running read
let drop = null; // cuts the current connection (the reader then reattaches)
let reconnects = 0;
let starting = false;
let deciding = false;
let shownApprovals = ""; // what the approvals box shows, to rebuild it only when it changes

const newId = () =>
  globalThis.crypto?.randomUUID?.() ?? `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;

function hashParams() {
  return new URLSearchParams(location.hash.slice(1));
}

function keep() {
  // replaceState: keeping the position should not add history entries
  const params = new URLSearchParams({ turn: turnId, stream: streamId });
  if (token) params.set("token", token);
  if (state?.lastId) params.set("offset", state.lastId);
  history.replaceState(null, "", `#${params}`);
  try {
    sessionStorage.setItem(`turn:${turnId}`, JSON.stringify(state));
  } catch {
    // storage full or disabled: the hash alone still resumes (from the start)
  }
}

function renderApprovals(viewer) {
  const approvals = [...(state?.approvals.values() ?? [])];
  const shown = JSON.stringify([approvals, viewer, deciding]);
  if (shown === shownApprovals) return;
  shownApprovals = shown;
  const box = $("approvals");
  box.replaceChildren();
  box.hidden = approvals.length === 0;
  for (const { request, decision } of approvals) {
    const id = request?.approval_id ?? decision?.approval_id;
    const row = document.createElement("div");
    row.className = "approval";
    row.dataset.testid = "approval";
    row.dataset.approvalId = id;
    row.dataset.state = decision?.decision ?? "pending";
    const call = document.createElement("code");
    call.textContent = request ? `${request.name}(${JSON.stringify(request.args)})` : id;
    row.append(call);
    if (decision) {
      const said = document.createElement("span");
      said.dataset.testid = "approval-decision";
      const why = decision.reason ? `: ${decision.reason}` : "";
      said.textContent = `${decision.decision === "approve" ? "allowed" : "denied"} (${decision.by}${why})`;
      row.append(said);
    } else if (!viewer) {
      for (const [label, verdict] of [["Allow", "approve"], ["Deny", "deny"]]) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = label;
        button.dataset.testid = verdict === "approve" ? "allow" : "deny";
        button.disabled = deciding;
        button.addEventListener("click", () => decide(id, verdict));
        row.append(button);
      }
    } else {
      const waits = document.createElement("span");
      waits.textContent = "waits for a person";
      row.append(waits);
    }
    box.append(row);
  }
}

async function decide(approvalId, verdict) {
  showError(null);
  deciding = true;
  render();
  try {
    // The first decision wins; the one that stands also arrives on the stream, in every tab.
    const standing = verdict === "approve"
      ? await client.approve(turnId, approvalId)
      : await client.deny(turnId, approvalId, { reason: "denied on the demo page" });
    if (standing.decision !== verdict) showError(`Another decision stood: ${standing.decision}`);
  } catch (error) {
    showError(error);
  } finally {
    deciding = false;
    render();
  }
}

function render() {
  const waiting = state?.status == null && (state?.pendingApprovals.length ?? 0) > 0;
  const running = reading ? (waiting ? "awaiting_approval" : "streaming") : state ? "waiting" : "idle";
  const status = state?.status ?? (starting ? "starting" : running);
  const badge = $("status");
  badge.textContent = status;
  badge.dataset.status = status;
  $("prefix").textContent = state?.prefix ?? "";
  $("own").textContent = state?.slot?.text ?? "";
  const viewer = token !== null;
  renderApprovals(viewer);
  $("answer").classList.toggle("partial", status === "interrupted");
  $("recovery").hidden = viewer || status !== "interrupted" || reading !== null;
  $("composer").hidden = viewer;
  $("credentials").hidden = viewer;
  $("viewer-note").hidden = !viewer;
  $("stop").hidden = viewer;
  $("stop").disabled = !turnId || state?.status != null;
  $("share").hidden = viewer || !turnId;
  $("share").disabled = sharing || !turnId;
  $("drop").disabled = drop === null;
  $("reconnects").textContent = String(reconnects);
  $("turn-id").textContent = turnId ?? "none";
  $("attempt").textContent = state?.current != null ? String(state.current) : "–";
  const link = $("second-tab");
  link.hidden = !turnId || viewer;
  if (turnId) link.href = `#${new URLSearchParams({ turn: turnId, stream: streamId })}`;
  $("key-summary").textContent = client.apiKey ? "API key (set)" : "API key";
  $("forget-key").disabled = !client.apiKey;
}

function showError(error) {
  let text = error ? String(error.message ?? error) : "";
  if (error?.status === 401 && token !== null) {
    text = `This read-only link was refused (${error.code ?? "401"}); ask for a new one.`;
  } else if (error?.status === 401) {
    // The broker has credentials configured: ask for a key, then the user sends again.
    const details = $("credentials");
    details.open = true;
    $("key-note").textContent = client.apiKey
      ? "The broker refused this key (401). Enter another one."
      : "This broker needs an API key (it answered 401). Enter it, then try again.";
    $("api-key").focus();
    text = `${text} (${error.code ?? "unauthorized"})`;
  }
  $("error").textContent = text;
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
      token: token ?? undefined,
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
  const toolCalls = $("knob-tools").value.trim();
  if (toolCalls !== "") simulate.tool_calls = JSON.parse(toolCalls); // a SyntaxError is shown
  return { simulate };
}

async function send(event) {
  event.preventDefault();
  showError(null);
  let params;
  try {
    params = knobs();
  } catch (error) {
    showError(error);
    return;
  }
  reading?.abort();
  turnId = newId();
  state = new TurnState(turnId);
  streamId = null;
  reconnects = 0;
  starting = true;
  $("share-box").hidden = true;
  render();
  try {
    const turn = await client.startTurn({
      conversationId: `demo-${turnId}`,
      turnId,
      messages: [{ role: "user", content: $("prompt").value }],
      params,
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

async function share() {
  showError(null);
  sharing = true;
  render();
  try {
    const minted = await client.mintAttachToken(turnId, { ttlS: SHARE_TTL_S });
    const params = new URLSearchParams({
      turn: minted.turn_id ?? turnId, stream: minted.stream_id, token: minted.token,
    });
    const url = `${location.origin}${location.pathname}#${params}`;
    $("share-link").href = url;
    $("share-url").value = url;
    $("share-expires").textContent = new Date(minted.expires_at * 1000).toLocaleTimeString();
    $("share-box").hidden = false;
  } catch (error) {
    showError(error);
  } finally {
    sharing = false;
    render();
  }
}

function saveKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  client.apiKey = key || null;
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: the key is used until the page goes away
  }
  $("api-key").value = "";
  $("key-note").textContent = key
    ? "Key set for this tab. Send again."
    : "No key: the page calls the broker without credentials.";
  showError(null);
  // A read that was refused for want of a key picks up where it was.
  if (turnId && streamId && !reading && state?.status == null) follow(state?.lastId ?? "-1");
  render();
}

function forgetKey() {
  $("api-key").value = "";
  saveKey(new Event("submit"));
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
  token = params.get("token") || null;
  const saved = sessionStorage.getItem(`turn:${turnId}`);
  state = saved ? TurnState.fromJSON(JSON.parse(saved)) : new TurnState(turnId);
  // Only trust an offset that matches the text we kept; otherwise read from the start.
  follow(saved && state.lastId ? state.lastId : "-1");
}

$("composer").addEventListener("submit", send);
$("key-form").addEventListener("submit", saveKey);
$("forget-key").addEventListener("click", forgetKey);
$("share").addEventListener("click", share);
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
