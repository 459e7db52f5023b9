"""Settings, read once from ``BROKER_*`` environment variables and frozen.

Every knob of the broker lives here with its default; docs/settings.md is generated from this
module (python scripts/settings_page.py). Code receives a ``Settings`` instance explicitly and
never reads the environment itself.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping
from typing import Any

from broker.errors import BrokerError
from broker.networks import parse_networks
from broker.webhook_config import (
    WebhookConfigError,
    decode_secret,
    parse_hosts,
    parse_tenant_urls,
    parse_url,
)

ROLES = ("all", "api", "worker")
FAST_PATH_MODES = ("auto", "off")
MAX_WORKERS = 64
# The providers a broker can serve (BROKER_PROVIDERS names some of them).
PROVIDER_NAMES = ("simulated", "openai", "anthropic")
SIMULATE_SCRIPTING = ("auto", "on", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A cluster URL names one or more of its nodes: redis+cluster://[user:password@]host:port,host:port
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


# Settings with a range: (lowest, highest).
BOUNDED = {
    "port": (0, 65_535),  # 0: any free port
    "openai_continue_final_message": (0, 1),
    "job_partitions": (1, 1024),
    "replica_acks": (0, 16),  # 0: writes do not wait for replicas
    "replica_wait_ms": (1, 60_000),
    "long_poll_max_s": (0, 300),  # 0: no long polls (a ?wait= above 0 is refused)
    "sse_batch_max_ms": (0, 10_000),  # 0: no batching (a ?batch_ms= above 0 is refused)
    "append_linger_ms": (0, 1_000),  # 0: an append goes as soon as the last one is done
    "append_burst_deltas": (2, 1_000),
    "sse_page_cache_s": (0, 60),  # 0: every reader reads its pages from Redis
    "ds_long_poll_s": (0.05, 300),
    "ds_sse_max_s": (1, 3_600),
    "ds_max_read_bytes": (1_024, 1_073_741_824),
    "ds_max_appends": (1, 100_000_000),
    "webhook_max_tries": (1, 1000),
    "webhook_backoff_ms": (1, 3_600_000),
    "webhook_backoff_max_ms": (1, 86_400_000),
    "webhook_recheck_ms": (10, 60_000),
}


class SettingsError(BrokerError, ValueError):
    """A ``BROKER_*`` variable has a value the broker cannot use."""

    code = "bad_setting"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The broker's configuration; build with :meth:`from_env` or directly in tests."""

    redis_url: str | None = dataclasses.field(default=None, repr=False)  # may hold a password
    redis_server: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    role: str = "all"
    workers: str = "1"  # processes serving one port: a number, or auto (one per core)
    key_prefix: str = "broker"
    stream_ttl: float = 86_400.0  # seconds
    tombstone_ttl: float = 7 * 86_400.0  # seconds
    max_stream_events: int = 20_000
    max_body_bytes: int = 1_048_576
    max_messages: int = 1_000
    max_message_chars: int = 200_000
    lease_ttl_ms: int = 10_000
    job_reclaim_idle_ms: int = 0  # 0: follow the lease (BROKER_LEASE_TTL_MS plus 500 ms)
    job_partitions: int = 16  # job streams, each in a slot of its own (spread over a cluster)
    replica_acks: int = 0  # replicas each script's write waits for (WAIT); 0: do not wait
    replica_wait_ms: int = 500  # how long a write waits for them before it goes on anyway
    worker_concurrency: int = 64
    append_linger_ms: float = 40.0  # how long an append waits for more deltas to share it
    append_burst_deltas: int = 8  # that many deltas within the linger are a burst
    sse_heartbeat_s: float = 15.0
    sse_heartbeat_max_s: float = 120.0  # the longest heartbeat period a client may ask for
    sse_batch_max_ms: int = 1_000  # the longest ?batch_ms= an SSE reader may ask for
    sse_retry_ms: int = 1_000
    sse_send_timeout_s: float = 30.0
    compression: str = "on"  # on | off: gzip for clients that ask (Accept-Encoding)
    drain_timeout_s: float = 10.0
    json_page_size: int = 1_000
    long_poll_max_s: float = 25.0  # the longest ?wait= of a JSON page (a long poll)
    ds_long_poll_s: float = 20.0  # how long a Durable Streams long poll waits for data
    ds_sse_max_s: float = 60.0  # a Durable Streams SSE response ends after this (clients resume)
    ds_max_read_bytes: int = 4_194_304  # about the most one Durable Streams read returns
    ds_max_appends: int = 1_000_000  # the most appends one Durable Streams stream holds
    sse_replay_page: int = 4_096  # events per read (and per write) when an SSE reader replays
    sse_page_cache_s: float = 1.0  # how long a full page read is kept for the next readers
    simulate_max_tokens_per_s: float = 0.0
    max_attempts_per_turn: int = 2
    session_retry_budget: int = 20
    session_retry_window: float = 60.0  # seconds
    retry_backoff_min_ms: int = 200
    retry_backoff_max_ms: int = 400
    upstream_idle_timeout_s: float = 60.0
    tools: str | None = None  # path of the tools file
    openai_base_url: str | None = None
    openai_api_key: str | None = dataclasses.field(default=None, repr=False)
    openai_models: str | None = None  # comma-separated; the first is the default
    openai_continue_final_message: int = 0  # 1: vLLM's continue_final_message for `continue`
    anthropic_base_url: str | None = None
    anthropic_api_key: str | None = dataclasses.field(default=None, repr=False)
    anthropic_models: str | None = None  # comma-separated; the first is the default
    anthropic_max_tokens: int = 4096
    # The providers served, and whether callers may script the simulator's faults and tool
    # calls (broker.providers): see served_providers and simulate_scripting_on.
    providers: str | None = None  # comma-separated, the first the default; unset: see below
    simulate_scripting: str = "auto"  # on | off | auto: on only on an open broker
    max_tool_steps: int = 8
    tool_lease_ms: int = 30_000
    tool_in_flight_wait_s: float = 30.0
    approval_ttl_s: float = 86_400.0  # a pending approval is denied (expired) after this
    log_level: str = "INFO"
    log_format: str = "text"  # text | json
    # Security. With no API keys and no JWT key the broker runs open (local development only).
    api_keys: str | None = dataclasses.field(default=None, repr=False)  # tenant=key,tenant=key
    api_keys_file: str | None = None  # lines of tenant=key
    jwt_secret: str | None = dataclasses.field(default=None, repr=False)  # HS256
    jwt_public_key: str | None = None  # path of a PEM public key: RS256
    jwt_tenant_claim: str = "sub"
    jwt_audience: str | None = None
    jwt_issuer: str | None = None
    attach_secret: str | None = dataclasses.field(default=None, repr=False)
    attach_token_ttl: float = 900.0  # seconds
    attach_token_max_ttl: float = 86_400.0  # seconds
    metrics_token: str | None = dataclasses.field(default=None, repr=False)
    cors_origins: str | None = None  # comma-separated origins, or *
    max_header_bytes: int = 16_384
    header_timeout_s: float = 10.0  # from a connection's (or request's) first byte to its headers
    max_connections: int = 10_000  # HTTP connections one process serves; 503 beyond
    pool_trim_s: float = 30.0  # how often idle Redis connections (past a few, or unused) close
    # auto | off: the HTTP protocol and Redis pools that reach past uvicorn's and redis-py's
    # public interfaces (broker.fastpath), while the installed releases still have what they
    # touch; off: stock uvicorn and redis-py, with the same limits.
    fast_path: str = "auto"
    turn_rate_per_s: float = 10.0  # per tenant; 0 = no rate limit
    turn_burst: int = 100
    max_streams_per_tenant: int = 200  # turns queued or generating at once; 0 = no limit
    # Completion webhooks (broker.webhooks, broker.notifier); off without a secret.
    webhook_secret: str | None = dataclasses.field(default=None, repr=False)  # whsec_<base64>
    webhook_url: str | None = None  # an open broker's, and the tenants' without their own
    webhook_urls: str | None = None  # tenant=url,tenant=url
    webhook_hosts: str | None = None  # hosts[:port] a turn's notify.url may name; *.example.com
    webhook_allow_private: int = 0  # 1: per-turn URLs may reach loopback and private addresses
    webhook_allow_loopback: int = 0  # 1: per-turn and subscription URLs may reach loopback
    webhook_max_tries: int = 12  # sends of one notification before it is given up
    webhook_backoff_ms: int = 1_000  # the pause after the first failed send, doubled after each
    webhook_backoff_max_ms: int = 600_000  # the longest pause
    webhook_timeout_s: float = 10.0  # one send, connect to answer
    webhook_recheck_ms: int = 1_500  # how often a notification's turn is looked at again
    # Connections: the body deadline and each caller's share (broker.fastpath).
    body_timeout_s: float = 30.0  # from a request's complete headers to the end of its body
    max_connections_per_address: int = 0  # 0: a quarter of BROKER_MAX_CONNECTIONS
    max_connections_per_tenant: int = 0  # requests in flight; 0: half of BROKER_MAX_CONNECTIONS
    uncapped_addresses: str = "loopback"  # not capped per address: loopback, none, IPs, networks
    # Durable Streams quotas, per tenant (an open broker's callers share one); 0 = no limit.
    ds_tenant_max_streams: int = 1_000  # streams a tenant keeps at once (forks included)
    ds_tenant_max_bytes: int = 67_108_864  # bytes a tenant's streams hold (a fork: what it adds)
    ds_tenant_appends_per_s: float = 200.0  # appends (and creations) per second
    ds_tenant_append_burst: int = 2_000  # the bucket: appends a quiet tenant may make at once

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_numbers(self)
        _check_webhooks(self)
        _check_connections(self)
        _check_providers(self)
        _check_durable_quotas(self)
        _check_relations(self)
        _check_secrets(self)

    @property
    def cluster(self) -> bool:
        """Whether ``BROKER_REDIS_URL`` names a Redis Cluster."""
        return self.redis_url is not None and "+cluster://" in self.redis_url.split("?")[0][:20]

    @property
    def address_share(self) -> int:
        """The most connections one client address may hold open (``BROKER_MAX_CONNECTIONS_PER_
        ADDRESS``, by default a quarter of ``BROKER_MAX_CONNECTIONS``)."""
        return self.max_connections_per_address or max(1, self.max_connections // 4)

    @property
    def tenant_share(self) -> int:
        """The most requests one tenant may have in flight (``BROKER_MAX_CONNECTIONS_PER_TENANT``,
        by default half of ``BROKER_MAX_CONNECTIONS``)."""
        return self.max_connections_per_tenant or max(1, self.max_connections // 2)

    @property
    def uncapped_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """The networks of ``BROKER_UNCAPPED_ADDRESSES``, ``loopback`` spelled out."""
        return parse_networks(self.uncapped_addresses)

    @property
    def credentials_on(self) -> bool:
        """Whether callers must authenticate (API keys or a JWT key are set)."""
        return bool(self.api_keys or self.api_keys_file or self.jwt_secret or self.jwt_public_key)

    @property
    def served_providers(self) -> tuple[str, ...]:
        """The providers turns may name, the first the default: ``BROKER_PROVIDERS`` as listed;
        unset, the simulator and every provider with models configured, except that a broker
        with credentials and a real provider leaves the simulator out (it answers with a model,
        never with made-up text, unless the operator lists ``simulated``)."""
        if self.providers:
            return _provider_list(self.providers)
        real = tuple(
            name
            for name, models in (
                ("openai", self.openai_models),
                ("anthropic", self.anthropic_models),
            )
            if _listed(models)
        )
        if real and self.credentials_on:
            return real
        return ("simulated", *real)

    @property
    def simulate_scripting_on(self) -> bool:
        """Whether a turn may script the simulator's faults and tool calls: ``on``, ``off``, or
        (``auto``) only when the broker is open, for anyone who reaches an open broker may do
        anything already."""
        if self.simulate_scripting == "auto":
            return not self.credentials_on
        return self.simulate_scripting == "on"

    @property
    def runs_api(self) -> bool:
        return self.role in ("all", "api")

    @property
    def runs_worker(self) -> bool:
        return self.role in ("all", "worker")

    @property
    def stream_ttl_ms(self) -> int:
        """``BROKER_STREAM_TTL`` in milliseconds: how long a finished turn's data is kept."""
        return int(self.stream_ttl * 1000)

    @property
    def tombstone_ttl_ms(self) -> int:
        """``BROKER_TOMBSTONE_TTL`` in milliseconds: how long an expired turn's id stays taken."""
        return int(self.tombstone_ttl * 1000)

    @property
    def index_ttl_ms(self) -> int:
        """How long the turn and stream indexes (and the ledger) live: data, then tombstone."""
        return int((self.stream_ttl + self.tombstone_ttl) * 1000)

    @property
    def session_retry_window_ms(self) -> int:
        """``BROKER_SESSION_RETRY_WINDOW`` in milliseconds."""
        return int(self.session_retry_window * 1000)

    @property
    def lease_ttl_s(self) -> float:
        """``BROKER_LEASE_TTL_MS`` in seconds."""
        return self.lease_ttl_ms / 1000

    @property
    def reclaim_idle_ms(self) -> int:
        """How long a job sits unrefreshed before another worker takes it over.

        A live worker refreshes its job with every lease renewal, so a job idle past the lease
        TTL belongs to a worker whose lease has run out: takeover follows the lease.
        """
        return self.job_reclaim_idle_ms or self.lease_ttl_ms + 500

    @property
    def reclaim_idle_s(self) -> float:
        """:attr:`reclaim_idle_ms` in seconds."""
        return self.reclaim_idle_ms / 1000

    @property
    def reclaim_every_s(self) -> float:
        """The period of the reclaim pass: a crashed turn is taken over within a second (or a
        quarter of the reclaim time) after its lease; more often would only cost commands."""
        return min(1.0, self.reclaim_idle_ms / 4000)

    @property
    def lease_heartbeat_s(self) -> float:
        """A lease is renewed three times per lease period, so one lost renewal is harmless."""
        return self.lease_ttl_ms / 3000.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``BROKER_<FIELD>`` for every field; explicit ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(f"BROKER_{field.name.upper()}")
            if raw is None or raw == "":
                continue
            values[field.name] = _parse(field.name, str(field.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# Durations read as seconds, or with a unit: 500ms, 30s, 15m, 24h, 7d.
DURATIONS = frozenset(
    {
        "stream_ttl",
        "tombstone_ttl",
        "session_retry_window",
        "attach_token_ttl",
        "attach_token_max_ttl",
        "ds_long_poll_s",
        "ds_sse_max_s",
    }
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(raw: str) -> float:
    """Seconds from ``"90"``, ``"500ms"``, ``"30s"``, ``"15m"``, ``"24h"`` or ``"7d"``."""
    text = raw.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * _UNITS[unit]
    return float(text)


def _parse(name: str, type_name: str, raw: str) -> Any:
    """A variable's text as its field's type: a number must be finite, an integer whole."""
    try:
        if name in DURATIONS:
            value: float = parse_duration(raw)
        elif type_name == "int":
            return int(raw)
        elif type_name == "float":
            value = float(raw)
        else:
            return raw
    except ValueError:
        kind = "a duration (like 90, 30s, 24h)" if name in DURATIONS else "a number"
        if type_name == "int":
            kind = "a whole number"
        raise SettingsError(f"BROKER_{name.upper()} must be {kind}, not {_shown(raw)}") from None
    if not math.isfinite(value):
        raise SettingsError(f"BROKER_{name.upper()} must be a finite number, not {_shown(raw)}")
    return value


def _shown(raw: object) -> str:
    """A bad value as an error message quotes it: short enough for one line."""
    text = repr(raw)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _check_choices(settings: Settings) -> None:
    """The settings that take one of a few words, the Redis URL's scheme, the key prefix."""
    if settings.log_level.upper() not in LOG_LEVELS:
        levels = ", ".join(LOG_LEVELS)
        raise SettingsError(
            f"BROKER_LOG_LEVEL must be one of {levels}, not {_shown(settings.log_level)}"
        )
    if settings.log_format not in ("text", "json"):
        raise SettingsError(f"BROKER_LOG_FORMAT must be text or json, not {settings.log_format!r}")
    if settings.compression not in ("on", "off"):
        raise SettingsError(f"BROKER_COMPRESSION must be on or off, not {settings.compression!r}")
    if settings.role not in ROLES:
        raise SettingsError(f"BROKER_ROLE must be one of {', '.join(ROLES)}, not {settings.role!r}")
    if settings.redis_url is not None and not settings.redis_url.startswith(REDIS_URL_SCHEMES):
        shown = settings.redis_url.partition("://")[0][:20] if "://" in settings.redis_url else "?"
        raise SettingsError(
            "BROKER_REDIS_URL must start with redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://, "
            f"not {shown}:// (the URL is not repeated: it may hold a password)"
        )
    if not settings.key_prefix or any(c in settings.key_prefix for c in "{} \n"):
        raise SettingsError("BROKER_KEY_PREFIX must be non-empty without braces or spaces")


def _check_relations(settings: Settings) -> None:
    """Settings bounded by each other, or by a floor of their own."""
    if settings.sse_heartbeat_max_s < settings.sse_heartbeat_s:
        raise SettingsError("BROKER_SSE_HEARTBEAT_MAX_S must be at least BROKER_SSE_HEARTBEAT_S")
    if settings.max_stream_events < 8:
        raise SettingsError("BROKER_MAX_STREAM_EVENTS must be at least 8")
    if (
        settings.job_reclaim_idle_ms < 0
        or 0 < settings.job_reclaim_idle_ms <= settings.lease_ttl_ms
    ):
        raise SettingsError(
            "BROKER_JOB_RECLAIM_IDLE_MS must exceed BROKER_LEASE_TTL_MS (or be 0: follow it)"
        )
    if settings.session_retry_budget < 0:
        raise SettingsError("BROKER_SESSION_RETRY_BUDGET must be 0 (no retries) or more")
    if not 0 <= settings.retry_backoff_min_ms <= settings.retry_backoff_max_ms:
        raise SettingsError(
            "BROKER_RETRY_BACKOFF_MIN_MS must be from 0 to BROKER_RETRY_BACKOFF_MAX_MS"
        )
    if settings.simulate_max_tokens_per_s < 0:
        raise SettingsError("BROKER_SIMULATE_MAX_TOKENS_PER_S must be 0 (no cap) or more")
    if settings.turn_rate_per_s < 0 or settings.max_streams_per_tenant < 0:
        raise SettingsError(
            "BROKER_TURN_RATE_PER_S and BROKER_MAX_STREAMS_PER_TENANT must be 0 (off) or more"
        )
    if settings.turn_rate_per_s > 0 and settings.turn_burst < 1:
        raise SettingsError("BROKER_TURN_BURST must be at least 1")


def _check_secrets(settings: Settings) -> None:
    """Credentials: given together where they must be, and apart where they must not."""
    if settings.anthropic_models and not settings.anthropic_api_key:
        raise SettingsError("BROKER_ANTHROPIC_MODELS is set but BROKER_ANTHROPIC_API_KEY is not")
    if settings.attach_token_ttl > settings.attach_token_max_ttl:
        raise SettingsError("BROKER_ATTACH_TOKEN_TTL must not exceed BROKER_ATTACH_TOKEN_MAX_TTL")
    if settings.attach_secret is not None and len(settings.attach_secret) < 32:
        raise SettingsError("BROKER_ATTACH_SECRET must be at least 32 characters")
    if settings.attach_secret is not None and settings.attach_secret == settings.jwt_secret:
        raise SettingsError(
            "BROKER_ATTACH_SECRET must differ from BROKER_JWT_SECRET: whoever issues JWTs "
            "could otherwise forge attach tokens"
        )
    if settings.jwt_secret is not None and settings.jwt_public_key is not None:
        raise SettingsError(
            "set BROKER_JWT_SECRET (HS256) or BROKER_JWT_PUBLIC_KEY (RS256), not both"
        )


def _check_numbers(settings: Settings) -> None:
    """Every number is finite, the settings with a range are in it, the positive ones positive."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise SettingsError(f"BROKER_{field.name.upper()} must be a finite number")
    for name, (low, high) in BOUNDED.items():
        value = getattr(settings, name)
        if not low <= value <= high:
            raise SettingsError(
                f"BROKER_{name.upper()} must be from {low} to {high}, not {_shown(value)}"
            )
    positive = (
        "stream_ttl",
        "tombstone_ttl",
        "max_stream_events",
        "max_body_bytes",
        "max_messages",
        "max_message_chars",
        "lease_ttl_ms",
        "worker_concurrency",
        "sse_heartbeat_s",
        "sse_retry_ms",
        "sse_send_timeout_s",
        "drain_timeout_s",
        "json_page_size",
        "sse_replay_page",
        "max_attempts_per_turn",
        "session_retry_window",
        "upstream_idle_timeout_s",
        "anthropic_max_tokens",
        "max_tool_steps",
        "tool_lease_ms",
        "tool_in_flight_wait_s",
        "approval_ttl_s",
        "attach_token_ttl",
        "attach_token_max_ttl",
        "max_header_bytes",
        "header_timeout_s",
        "max_connections",
        "pool_trim_s",
    )
    for name in positive:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"BROKER_{name.upper()} must be positive")


def _check_connections(settings: Settings) -> None:
    """The connection settings are in range, and the uncapped addresses parse."""
    if settings.fast_path not in FAST_PATH_MODES:
        raise SettingsError(
            f"BROKER_FAST_PATH must be auto or off, not {_shown(settings.fast_path)}"
        )
    if settings.workers != "auto" and not (
        settings.workers.isdigit() and 1 <= int(settings.workers) <= MAX_WORKERS
    ):
        raise SettingsError(
            f"BROKER_WORKERS must be auto or from 1 to {MAX_WORKERS}, "
            f"not {_shown(settings.workers)}"
        )
    if not settings.body_timeout_s > 0:  # (NaN too)
        raise SettingsError("BROKER_BODY_TIMEOUT_S must be positive")
    for name in ("max_connections_per_address", "max_connections_per_tenant"):
        if getattr(settings, name) < 0:
            raise SettingsError(
                f"BROKER_{name.upper()} must be 0 (a share of BROKER_MAX_CONNECTIONS) or more"
            )
    try:
        parse_networks(settings.uncapped_addresses)
    except ValueError:
        raise SettingsError(
            "BROKER_UNCAPPED_ADDRESSES must be a comma-separated list of addresses, networks "
            f"(10.0.0.0/8), loopback or none, not {settings.uncapped_addresses[:80]!r}"
        ) from None


def _listed(raw: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item.strip() for item in (raw or "").split(",") if item.strip()))


def _provider_list(raw: str) -> tuple[str, ...]:
    return tuple(name.lower() for name in _listed(raw))


def _check_providers(settings: Settings) -> None:
    """``BROKER_PROVIDERS`` names known providers, each with its models configured, and
    ``BROKER_SIMULATE_SCRIPTING`` is a known word."""
    if settings.simulate_scripting not in SIMULATE_SCRIPTING:
        raise SettingsError(
            f"BROKER_SIMULATE_SCRIPTING must be one of {', '.join(SIMULATE_SCRIPTING)}, "
            f"not {settings.simulate_scripting[:40]!r}"
        )
    if settings.providers is None:
        return
    names = _provider_list(settings.providers)
    if not names:
        raise SettingsError(
            f"BROKER_PROVIDERS must name at least one of {', '.join(PROVIDER_NAMES)}"
        )
    for name in names:
        if name not in PROVIDER_NAMES:
            raise SettingsError(
                f"BROKER_PROVIDERS names {name[:40]!r}; known: {', '.join(PROVIDER_NAMES)}"
            )
    for name, models in (
        ("openai", settings.openai_models),
        ("anthropic", settings.anthropic_models),
    ):
        if name in names and not _listed(models):
            raise SettingsError(
                f"BROKER_PROVIDERS lists {name} but BROKER_{name.upper()}_MODELS is unset"
            )


def _check_webhooks(settings: Settings) -> None:
    """The webhook settings parse, and a configured URL has a secret to sign with."""
    values = (
        ("BROKER_WEBHOOK_SECRET", settings.webhook_secret, decode_secret),
        ("BROKER_WEBHOOK_URL", settings.webhook_url, parse_url),
        ("BROKER_WEBHOOK_URLS", settings.webhook_urls, parse_tenant_urls),
        ("BROKER_WEBHOOK_HOSTS", settings.webhook_hosts, parse_hosts),
    )
    for name, value, parse in values:
        if not value:
            continue
        try:
            parse(value)
        except WebhookConfigError as exc:
            shown = "" if name == "BROKER_WEBHOOK_SECRET" else f" ({value[:80]!r})"
            raise SettingsError(f"{name} {exc}{shown}") from None
    if (settings.webhook_url or settings.webhook_urls) and not settings.webhook_secret:
        raise SettingsError(
            "BROKER_WEBHOOK_URL or BROKER_WEBHOOK_URLS is set but BROKER_WEBHOOK_SECRET is not: "
            "webhooks are signed (broker new-webhook-secret prints one)"
        )
    for name in ("allow_private", "allow_loopback"):
        if getattr(settings, f"webhook_{name}") not in (0, 1):
            raise SettingsError(f"BROKER_WEBHOOK_{name.upper()} must be 0 or 1")
    if settings.webhook_backoff_ms > settings.webhook_backoff_max_ms:
        raise SettingsError(
            "BROKER_WEBHOOK_BACKOFF_MS must not exceed BROKER_WEBHOOK_BACKOFF_MAX_MS"
        )
    if settings.webhook_timeout_s <= 0:
        raise SettingsError("BROKER_WEBHOOK_TIMEOUT_S must be positive")


def _check_durable_quotas(settings: Settings) -> None:
    """The Durable Streams quotas are 0 (off) or more, and a rate has a bucket to take from."""
    for name in (
        "ds_tenant_max_streams",
        "ds_tenant_max_bytes",
        "ds_tenant_appends_per_s",
        "ds_tenant_append_burst",
    ):
        if getattr(settings, name) < 0:
            raise SettingsError(f"BROKER_{name.upper()} must be 0 (no limit) or more")
    if settings.ds_tenant_appends_per_s > 0 and settings.ds_tenant_append_burst < 1:
        raise SettingsError("BROKER_DS_TENANT_APPEND_BURST must be at least 1")
