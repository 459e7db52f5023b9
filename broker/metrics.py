"""Every Prometheus metric of the broker, defined in one place.

Names follow ``broker_<noun>_<unit>``; counters end in ``_total``; labels come from small fixed
sets (never ids or messages) and every known label set is created at zero so that rates and
alerts work from the first scrape. Each app gets its own registry, so several brokers can run in
one process (the tests do) without sharing counts.

Several processes serving one port (``broker serve --workers N``) keep their values in files of
one directory, ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode: the
supervisor sets it for the processes it starts), and any of them answers a scrape with the sums:
counters and histograms added up, gauges added over the live processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from itertools import product

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from broker import __version__
from broker.scripts import NAMES as SCRIPT_NAMES

TURN_STATUSES = ("complete", "interrupted", "cancelled", "failed", "requires_action")
UPSTREAM_OUTCOMES = ("ok", "retryable_error", "fatal_error", "interrupted", "cancelled")
RETRY_REASONS = ("upstream_error", "upstream_timeout", "worker_lost")
BUDGET_SCOPES = ("turn", "session")
LEDGER_RESULTS = ("claimed", "completed", "failed", "in_flight", "args_mismatch", "reclaimed")
TOOL_OUTCOMES = ("ok", "error", "replayed", "unknown_outcome", "not_run")
INTERRUPTION_REASONS = ("upstream_error", "upstream_timeout", "worker_lost", "shutdown")
# The ``code`` label of retries, exhausted attempts and interruptions: the upstream error
# taxonomy's code (broker.providers.taxonomy), so that a dashboard tells rate limiting from an
# outage. The set is fixed: any other code counts as upstream_other, and a cause without an
# upstream error (a lost worker, a shutdown) as none.
RETRYABLE_ERROR_CODES = (
    "upstream_rate_limited",
    "upstream_overloaded",
    "upstream_unavailable",
    "upstream_timeout",
    "upstream_connection",
    "upstream_incomplete",
    "upstream_stream_error",
    "upstream_bad_response",
    "upstream_conflict",
)
ADMISSION_ERROR_CODES = (
    "upstream_bad_request",
    "upstream_unauthorized",
    "upstream_forbidden",
    "upstream_not_found",
    "upstream_unprocessable",
)
OTHER_ERROR_CODE = "upstream_other"
NO_ERROR_CODE = "none"
ERROR_CODES = (*RETRYABLE_ERROR_CODES, *ADMISSION_ERROR_CODES, OTHER_ERROR_CODE, NO_ERROR_CODE)
RESUME_RESULTS = ("ok", "expired", "not_found")
STREAM_MODES = ("sse", "json")
# The doors a stream read comes through (the viewers gauge's ``dialect`` label).
DIALECTS = ("native", "responses", "chat", "aisdk", "durable")
STRATEGIES = ("initial", "continue", "regenerate")
ATTEMPT_OUTCOMES = ("complete", "partial", "cancelled", "failed", "requires_action")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# What became of one send of a completion webhook (broker.notifier).
WEBHOOK_OUTCOMES = ("delivered", "retried", "gave_up")
# Why a webhook send was refused before any byte left (broker.webhook_config.REFUSAL_REASONS).
WEBHOOK_REFUSALS = ("host", "port", "address")
# From an attempt's end to its webhook's 2xx: a first try takes well under a second, retries
# take minutes.
WEBHOOK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600)


# Which Durable Streams quota refused a write (broker.durable_store).
DS_LIMITS = ("streams", "bytes", "rate")
AUTH_FAILURES = ("missing", "bad_credentials", "bad_token", "token_expired", "forbidden")
# Why the server ended a connection itself (see broker.fastpath).
CONNECTION_CLOSE_REASONS = (
    "header_timeout",
    "body_timeout",
    "headers_too_large",
    "invalid_http",
    "over_limit",
    "overflow",
    "address_overflow",
)
# The caps of one caller's share of a process's connections (see broker.fastpath).
CALLER_CAPS = ("address", "tenant")


class Metrics:
    """The broker's metrics, registered in their own registry."""

    def __init__(self, providers: dict[str, tuple[str, ...]] | None = None) -> None:
        """``providers`` maps each configured provider to its models (label values)."""
        providers = providers if providers is not None else {"simulated": ("simulated",)}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("broker_build", "Version of the broker.", registry=r)
        self.build_info.info({"version": __version__})
        self.turns_started = Counter(
            "broker_turns_started_total",
            "Turns created (not counting idempotent repeats).",
            registry=r,
        )
        self.turns_deduplicated = Counter(
            "broker_turns_deduplicated_total",
            "POST /v1/turns that found the existing turn of the same turn_id.",
            registry=r,
        )
        self.turns_finished = Counter(
            "broker_turns_finished_total",
            "Attempts that ended, by turn status.",
            ["status"],
            registry=r,
        )
        _at_zero(self.turns_finished, TURN_STATUSES)
        self.upstream_requests = Counter(
            "broker_upstream_requests_total",
            "Calls to the upstream model, by provider, model and outcome.",
            ["provider", "model", "outcome"],
            registry=r,
        )
        self.upstream_first_token_seconds = Histogram(
            "broker_upstream_first_token_seconds",
            "Time from an upstream call to its first text delta, by provider.",
            ["provider"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        _at_zero(self.upstream_first_token_seconds, tuple(providers))
        _at_zero(
            self.upstream_requests,
            [
                (provider, model, outcome)
                for provider, models in providers.items()
                for model, outcome in product(models, UPSTREAM_OUTCOMES)
            ],
        )
        self.attempts = Counter(
            "broker_attempts_total",
            "Attempts that ended, by strategy and outcome.",
            ["strategy", "outcome"],
            registry=r,
        )
        _at_zero(self.attempts, product(STRATEGIES, ATTEMPT_OUTCOMES))
        self.delivery_lag_seconds = Histogram(
            "broker_delivery_lag_seconds",
            "Time from an event's append to its hand-over to this process's live readers "
            "(once per event and process, whatever the number of readers).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lease_expirations = Counter(
            "broker_lease_expirations_total",
            "Writer leases that ran out under a running attempt (found at renewal).",
            registry=r,
        )
        self.fenced_writes = Counter(
            "broker_fenced_writes_total",
            "Writes refused because the writer's lease was lost or taken over.",
            registry=r,
        )
        self.replica_waits_short = Counter(
            "broker_replica_waits_short_total",
            "Script writes whose WAIT ended before BROKER_REPLICA_ACKS replicas had them "
            "(the write stands; a failover now could lose it).",
            ["script"],
            registry=r,
        )
        _at_zero(self.replica_waits_short, SCRIPT_NAMES)
        self.lease_takeovers = Counter(
            "broker_lease_takeovers_total",
            "Leases claimed on a turn whose previous writer stopped heartbeating.",
            registry=r,
        )
        self.resumes = Counter(
            "broker_resumes_total",
            "Stream reads that resumed from an offset, by result.",
            ["result"],
            registry=r,
        )
        _at_zero(self.resumes, RESUME_RESULTS)
        self.live_streams = Gauge(
            "broker_live_streams",
            "Streams with at least one live reader in this broker's processes.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.viewers = Gauge(
            "broker_stream_viewers",
            "Open stream reads in this broker's processes, by mode and by door.",
            ["mode", "dialect"],
            registry=r,
            multiprocess_mode="livesum",
        )
        _at_zero(self.viewers, product(STREAM_MODES, DIALECTS))
        self.append_seconds = Histogram(
            "broker_append_seconds",
            "Time of one fenced append to a turn's stream.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.redis_errors = Counter(
            "broker_redis_errors_total",
            "Redis commands that failed (connection or server).",
            registry=r,
        )
        self.eviction_policy_safe = Gauge(
            "broker_redis_eviction_policy_safe",
            "1 when Redis maxmemory-policy is noeviction, 0 when keys may be evicted or unknown.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.retries = Counter(
            "broker_retries_total",
            "Silent retries of an upstream call before its first delta, by reason and by the "
            "upstream error's code (none for a lost worker).",
            ["reason", "code"],
            registry=r,
        )
        _at_zero(self.retries, _causes(RETRY_REASONS, (*RETRYABLE_ERROR_CODES, OTHER_ERROR_CODE)))
        self.retry_budget_exhausted = Counter(
            "broker_retry_budget_exhausted_total",
            "Retries refused by a limit: the per-turn cap (turn) or the session budget (session).",
            ["scope"],
            registry=r,
        )
        _at_zero(self.retry_budget_exhausted, BUDGET_SCOPES)
        self.attempts_exhausted = Counter(
            "broker_attempts_exhausted_total",
            "Attempts failed because every upstream call allowed for them failed, by the last "
            "upstream error's code (none for a lost worker).",
            ["code"],
            registry=r,
        )
        _at_zero(self.attempts_exhausted, (*RETRYABLE_ERROR_CODES, OTHER_ERROR_CODE, NO_ERROR_CODE))
        self.interruptions = Counter(
            "broker_interruptions_total",
            "Attempts that ended interrupted after text was delivered, by reason and by the "
            "upstream error's code (none for a lost worker or a shutdown).",
            ["reason", "code"],
            registry=r,
        )
        _at_zero(self.interruptions, _causes(INTERRUPTION_REASONS, ERROR_CODES[:-1]))
        self.cancels = Counter(
            "broker_cancels_total", "Stop requests, by what they found.", ["result"], registry=r
        )
        _at_zero(self.cancels, ("cancelled", "signalled", "final"))
        self.turns_refused = Counter(
            "broker_turns_refused_total",
            "Turns and attempts refused by a tenant limit: rate or live streams.",
            ["reason"],
            registry=r,
        )
        _at_zero(self.turns_refused, ("rate", "streams"))
        self.ds_refusals = Counter(
            "broker_ds_refusals_total",
            "Durable Streams writes refused by a tenant quota: streams, bytes or append rate.",
            ["limit"],
            registry=r,
        )
        _at_zero(self.ds_refusals, DS_LIMITS)
        self.auth_failures = Counter(
            "broker_auth_failures_total",
            "Requests refused for their credentials (401) or an attach token's scope (403).",
            ["reason"],
            registry=r,
        )
        _at_zero(self.auth_failures, AUTH_FAILURES)
        self.ledger_claims = Counter(
            "broker_ledger_claims_total",
            "Tool-call ledger claims, by what the claim found.",
            ["result"],
            registry=r,
        )
        _at_zero(self.ledger_claims, LEDGER_RESULTS)
        self.tool_calls = Counter(
            "broker_tool_calls_total",
            "Tool calls, by tool class and outcome.",
            ["tool_class", "outcome"],
            registry=r,
        )
        _at_zero(self.tool_calls, product(("read", "keyed_write", "unkeyed_write"), TOOL_OUTCOMES))
        self.approvals_requested = Counter(
            "broker_approvals_requested_total",
            "Tool calls that asked a person for approval (a new request, not one met again).",
            registry=r,
        )
        self.approvals_decided = Counter(
            "broker_approvals_decided_total",
            "Approvals decided, by decision (approve, deny) and by how (person, expiry, stop).",
            ["decision", "by"],
            registry=r,
        )
        _at_zero(self.approvals_decided, product(("approve", "deny"), ("person", "expiry", "stop")))
        self.approval_decision_seconds = Histogram(
            "broker_approval_decision_seconds",
            "Time from an approval's request to its decision, by how it was decided.",
            ["by"],
            buckets=(1, 5, 15, 60, 300, 900, 3_600, 14_400, 86_400),
            registry=r,
        )
        for by in ("person", "expiry", "stop"):
            self.approval_decision_seconds.labels(by)
        self.approvals_pending = Gauge(
            "broker_approvals_pending",
            "Approvals waiting for a person, as the last expiry sweep counted them (every "
            "process counts the same requests: the highest value is the answer).",
            registry=r,
            multiprocess_mode="max",
        )
        self.http_connections = Gauge(
            "broker_http_connections",
            "HTTP connections open in this broker's processes.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.connections_closed = Counter(
            "broker_http_connections_closed_total",
            "Connections the server ended itself, by reason: headers not complete within "
            "BROKER_HEADER_TIMEOUT_S, a body not complete within BROKER_BODY_TIMEOUT_S (408), "
            "headers past the parser's cap (431), opened past BROKER_MAX_CONNECTIONS (503), "
            "opened a tenth past it (closed unanswered), or opened a tenth past the address's "
            "share (closed unanswered).",
            ["reason"],
            registry=r,
        )
        _at_zero(self.connections_closed, CONNECTION_CLOSE_REASONS)
        self.caller_refusals = Counter(
            "broker_caller_refusals_total",
            "Requests refused 429 too_many_connections_for_caller, by the cap they met: the "
            "client address's open connections or the tenant's requests in flight.",
            ["cap"],
            registry=r,
        )
        _at_zero(self.caller_refusals, CALLER_CAPS)
        self.webhook_deliveries = Counter(
            "broker_webhook_deliveries_total",
            "Completion webhook sends, by outcome: delivered (a 2xx), retried (a failed send "
            "that will be tried again), gave_up (BROKER_WEBHOOK_MAX_TRIES failed, or no target).",
            ["outcome"],
            registry=r,
        )
        _at_zero(self.webhook_deliveries, WEBHOOK_OUTCOMES)
        self.webhook_delivery_seconds = Histogram(
            "broker_webhook_delivery_seconds",
            "Time from an attempt's end to the 2xx of its completion webhook, retries included.",
            buckets=WEBHOOK_BUCKETS,
            registry=r,
        )
        self.webhook_refusals = Counter(
            "broker_webhook_refusals_total",
            "Completion webhooks not sent because their per-turn URL was refused at send time, "
            "by reason: host or port (not in BROKER_WEBHOOK_HOSTS), address (it resolved to a "
            "loopback, private, link-local or other non-public address not allowed).",
            ["reason"],
            registry=r,
        )
        _at_zero(self.webhook_refusals, WEBHOOK_REFUSALS)
        self.requests_abandoned = Counter(
            "broker_requests_abandoned_total",
            "Requests whose client left before the whole body arrived (routine on mobile "
            "networks; nothing was done for them).",
            registry=r,
        )
        # The registry a scrape reads: this one, or with several processes the sums of all.
        self.shared_directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self._scraped = r
        if self.shared_directory is not None:
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped, self.shared_directory)  # type: ignore[no-untyped-call]
            self._scraped.register(self.build_info)  # the same in every process: not summed

    def exposition(self) -> bytes:
        """What ``/metrics`` answers: the Prometheus text format of every metric."""
        return generate_latest(self._scraped)


def error_code(code: str | None) -> str:
    """The ``code`` label for an upstream error's code: itself when the set knows it,
    upstream_other when not, none when there was no upstream error."""
    if code is None:
        return NO_ERROR_CODE
    return code if code in ERROR_CODES and code != NO_ERROR_CODE else OTHER_ERROR_CODE


def _reason_of(code: str) -> str:
    """The ``reason`` label of an upstream failure: a timeout, or any other upstream error."""
    return "upstream_timeout" if code == "upstream_timeout" else "upstream_error"


def _causes(reasons: tuple[str, ...], codes: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (reason, code) pairs that can occur: upstream reasons with the codes they cover,
    the others (worker_lost, shutdown) with none."""
    pairs = [(reason, NO_ERROR_CODE) for reason in reasons if not reason.startswith("upstream_")]
    pairs += [(_reason_of(code), code) for code in codes]
    return pairs


def _at_zero(metric: Counter | Gauge | Histogram, values: Iterable[str | tuple[str, ...]]) -> None:
    """Create a metric's series at zero, from the first scrape, for each of ``values``: one
    label's value, or a tuple of every label's."""
    for value in values:
        metric.labels(*((value,) if isinstance(value, str) else value))
