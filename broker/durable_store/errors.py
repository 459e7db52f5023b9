"""What the Durable Streams service refuses, as the broker's exceptions (see
:mod:`broker.errors`): the three classes of its own, and each refusal with its code, message
and the protocol's headers, built in one place.
"""

from __future__ import annotations

import math

from broker.durable_store import protocol
from broker.durable_store.replies import QuotaRefused, RateRefused
from broker.errors import BadRequest, BrokerError, Conflict, Gone, NotFound, TooManyRequests
from broker.frames import Cursor
from broker.metrics import Metrics
from broker.settings import Settings


class StaleEpoch(BrokerError):
    """A stale producer epoch: the writer is fenced."""

    code = "stale_epoch"
    status = 403


class AppendsFull(BrokerError):
    """The stream holds as many appends as a stream may."""

    code = "stream_full"
    status = 413


class QuotaExceeded(BrokerError):
    """A tenant holds as many Durable Streams streams, or bytes, as its quota allows."""

    code = "quota_exceeded"
    status = 429


def no_stream() -> NotFound:
    return NotFound("no such stream")


def deleted() -> Gone:
    return Gone("the stream is deleted (forks of it still live)", code="deleted")


def source_missing() -> NotFound:
    return NotFound("the fork's source does not exist")


def source_deleted() -> Conflict:
    return Conflict("the fork's source is deleted", code="source_deleted")


def past_tail() -> BadRequest:
    return BadRequest("Stream-Fork-Offset is past the source's tail", code="bad_fork")


def bad_fork(message: str) -> BadRequest:
    return BadRequest(message, code="bad_fork")


def closed(tail: Cursor) -> Conflict:
    """An append to a closed stream: its tail and closure go along, as the protocol asks."""
    headers = {protocol.NEXT_OFFSET: protocol.offset_of(tail), protocol.CLOSED: "true"}
    return Conflict("the stream is closed", code="stream_closed", headers=headers)


def type_mismatch(content_type: str) -> Conflict:
    return Conflict(f"the stream's content type is {content_type}", code="type_mismatch")


def stale_epoch(epoch: int) -> StaleEpoch:
    return StaleEpoch(
        "a newer epoch of this producer writes now", headers={"Producer-Epoch": str(epoch)}
    )


def epoch_not_at_zero() -> BadRequest:
    return BadRequest("a new producer epoch starts at Producer-Seq 0", code="bad_producer")


def sequence_gap(expected: int, received: int) -> Conflict:
    return Conflict(
        f"Producer-Seq {received} skips ahead: {expected} is next",
        code="sequence_gap",
        headers={"Producer-Expected-Seq": str(expected), "Producer-Received-Seq": str(received)},
    )


def stream_seq_behind(last: str) -> Conflict:
    return Conflict(f"Stream-Seq must sort after {last!r}", code="sequence_conflict")


def full(max_appends: int) -> AppendsFull:
    return AppendsFull(f"the stream holds BROKER_DS_MAX_APPENDS={max_appends} appends")


def refusal(reply: RateRefused | QuotaRefused, settings: Settings, metrics: Metrics) -> BrokerError:
    """What a tenant's quota refused, counted in ``broker_ds_refusals_total``."""
    if isinstance(reply, RateRefused):
        metrics.ds_refusals.labels("rate").inc()
        retry_after_s = math.ceil(reply.retry_after_ms / 1000)
        return TooManyRequests(
            "this tenant appends to its Durable Streams faster than "
            f"BROKER_DS_TENANT_APPENDS_PER_S={settings.ds_tenant_appends_per_s:g} (burst "
            f"{settings.ds_tenant_append_burst}); retry in {max(1, retry_after_s)} s",
            retry_after_s=retry_after_s,
            code="rate_limited",
        )
    metrics.ds_refusals.labels(reply.which).inc()
    if reply.which == "streams":
        return QuotaExceeded(
            f"this tenant holds BROKER_DS_TENANT_MAX_STREAMS={reply.limit} Durable Streams "
            "streams: delete one (or let one expire) first",
            code="stream_quota",
        )
    return QuotaExceeded(
        f"this would take this tenant's Durable Streams past "
        f"BROKER_DS_TENANT_MAX_BYTES={reply.limit} bytes: delete a stream (or let one "
        "expire) first",
        code="byte_quota",
    )
