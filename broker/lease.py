"""The writer side of a turn: a lease with a fencing token, fenced appends, an atomic finish.

A writer rides out a Redis blip (a restart, a failover, a cut connection) shorter than its lease:
an append or a finish that fails on the connection is sent again, with backoff, for as long as
the lease it last renewed is valid. Both are safe to send twice (an append names how many events
came before it; a finish recognises its own), so a reply lost to the blip never doubles an event.
Meanwhile the generation's deltas wait in its bounded queue. Past the lease, the error is raised
and the attempt ends as it would have.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.connection import drop_idle_connections
from broker.deps import Deps
from broker.scripts import Claim
from broker.vocabulary import ATTEMPT_STATUS, TurnStatus

log = logging.getLogger("broker.lease")

# A connection that failed: the server may be restarting. Anything else is an answer.
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
RETRY_BACKOFF_MIN_S = 0.05
RETRY_BACKOFF_MAX_S = 1.0

Event = tuple[str, dict[str, Any]]  # (event type, data) before it is encoded
_T = TypeVar("_T")


def encode(data: dict[str, Any]) -> str:
    return orjson.dumps(data).decode()


class TurnWriter:
    """Appends to one turn's stream under one fencing token; every call is checked by Lua.

    Its limits come from the settings: ``BROKER_LEASE_TTL_MS``, ``BROKER_MAX_STREAM_EVENTS``, and
    the retention of a finished turn (``BROKER_STREAM_TTL``, ``BROKER_TOMBSTONE_TTL``).
    """

    def __init__(self, deps: Deps, conversation_id: str, turn_id: str) -> None:
        keys, settings = deps.keys, deps.settings
        self._scripts = deps.scripts
        self._metrics = deps.metrics
        self._keys, self._ids = keys, (conversation_id, turn_id)
        self._turn = keys.turn(conversation_id, turn_id)
        self._lease = keys.lease(conversation_id, turn_id)
        self._events = keys.events(conversation_id, turn_id)
        self._tombstone = keys.tombstone(conversation_id, turn_id)
        self._conversation_turns = keys.conversation_turns(conversation_id)
        self._max_events = settings.max_stream_events
        self._lease_ttl_ms = settings.lease_ttl_ms
        self._lease_ttl_s = settings.lease_ttl_s
        self._retention_ms = settings.stream_ttl_ms
        self._tombstone_ms = settings.tombstone_ttl_ms
        self.token = ""
        self._appended = 0  # events appended under this token
        self._valid_until = 0.0  # (monotonic) the lease lasts at least this long

    def _renewed(self, since: float) -> None:
        self._valid_until = since + self._lease_ttl_s

    async def claim(self, owner: str, attempt: int) -> Claim:
        since = time.monotonic()
        claim = await self._scripts.claim_lease(
            turn=self._turn,
            lease=self._lease,
            events_key=self._events,
            owner=owner,
            ttl_ms=self._lease_ttl_ms,
            attempt=attempt,
        )
        if claim.result == "claimed":
            self.token = claim.token
            self._appended = 0
            self._renewed(since)
        return claim

    async def renew(self) -> bool:
        """Extend the lease; True when the user asked to stop. Raises ``FencedWrite`` if lost."""
        since = time.monotonic()
        stop = await self._scripts.renew_lease(
            lease=self._lease, turn=self._turn, token=self.token, ttl_ms=self._lease_ttl_ms
        )
        self._renewed(since)
        return stop

    async def _call(self, name: str, send: Callable[[], Awaitable[_T]]) -> _T:
        """Run a script that is safe to send twice, again and again while the connection fails
        and the lease is still valid; then raise the connection's error."""
        delay = RETRY_BACKOFF_MIN_S
        failures = 0
        while True:
            try:
                reply = await send()
            except CONNECTION_ERRORS as exc:
                left = self._valid_until - time.monotonic()
                if left <= 0:
                    raise
                self._metrics.redis_errors.inc()
                failures += 1
                if failures == 1:
                    log.warning(
                        "%s failed on the connection (%s): sending it again while the lease "
                        "lasts (%.1f s at most)",
                        name,
                        exc,
                        left,
                    )
                # Every idle connection went to the same server: if it restarted, they are dead.
                await drop_idle_connections(self._scripts.redis)
                await asyncio.sleep(min(random.uniform(0, delay), max(left, 0.0)))
                delay = min(delay * 2, RETRY_BACKOFF_MAX_S)
                continue
            if failures:
                log.info("%s went through after %d failed tries", name, failures)
            return reply

    async def park(
        self, attempt: int, record: dict[str, Any], text: str, approval_ids: list[str]
    ) -> str:
        """Let go of the turn while tool calls wait for approvals (``park_attempt.lua``):
        ``parked``, ``decided`` (go on) or ``stop``. Raises ``FencedWrite``."""
        conversation_id, turn_id = self._ids
        keys = self._keys
        reply = await self._call(
            "park_attempt",
            lambda: self._scripts.park_attempt(
                turn=self._turn,
                lease=self._lease,
                waiting=keys.approvals_waiting(conversation_id, turn_id),
                approvals=[
                    (keys.approval(conversation_id, turn_id, ident), ident)
                    for ident in approval_ids
                ],
                token=self.token,
                attempt=attempt,
                record=encode(record),
                text=text,
            ),
        )
        return reply.result

    async def release(self) -> bool:
        """Give the lease up now; False when it was no longer this writer's."""
        return await self._scripts.release_lease(lease=self._lease, token=self.token)

    async def append(self, events: list[Event]) -> list[str]:
        """Append events in order; returns their entry ids.

        Raises FencedWrite (lease lost), StopRequested (stop pressed) or StreamFull.
        """
        token, appended = self.token, self._appended
        encoded = [(kind, encode(data)) for kind, data in events]
        began = time.perf_counter()
        ids = await self._call(
            "append_events",
            lambda: self._scripts.append_events(
                lease=self._lease,
                events_key=self._events,
                turn=self._turn,
                token=token,
                max_events=self._max_events,
                appended=appended,
                events=encoded,
            ),
        )
        self._appended += len(events)
        self._metrics.append_seconds.observe(time.perf_counter() - began)
        return ids

    async def finish(
        self,
        *,
        record: dict[str, Any],
        status: TurnStatus | str,
        reason: str | None,
        text: str,
        promote: bool,
        base: str,
        before_end: Sequence[Event] = (),
    ) -> int:
        """Write the last events and the ``end`` sentinel, set the turn at rest, drop the lease.

        ``record`` is the attempt's record (n, strategy, ...); returns the promotion result:
        1 promoted to canonical, 0 not asked, -1 refused because the canonical attempt changed.
        ``status`` is a final turn status (a word that is not one raises ``ValueError``).
        """
        status = TurnStatus(status)
        attempt = int(record["n"])
        final = {**record, "status": ATTEMPT_STATUS[status], "reason": reason}
        events = [*before_end, ("end", {"attempt": attempt, "status": status, "reason": reason})]
        token, final_json = self.token, encode(final)
        encoded = [(kind, encode(data)) for kind, data in events]
        finished = await self._call(
            "finish_attempt",
            lambda: self._scripts.finish_attempt(
                turn=self._turn,
                lease=self._lease,
                events_key=self._events,
                tombstone=self._tombstone,
                conversation_turns=self._conversation_turns,
                token=token,
                attempt=attempt,
                status=status,
                record=final_json,
                text=text,
                ttl_ms=self._retention_ms,
                tombstone_ms=self._tombstone_ms,
                promote=promote,
                base=base,
                events=encoded,
            ),
        )
        self._metrics.turns_finished.labels(status).inc()
        return finished.promotion
