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
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.connection import drop_idle_connections
from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts

log = logging.getLogger("broker.lease")

# A connection that failed: the server may be restarting. Anything else is an answer.
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
RETRY_BACKOFF_MIN_S = 0.05
RETRY_BACKOFF_MAX_S = 1.0

FINAL_STATUSES = frozenset({"complete", "interrupted", "cancelled", "failed"})
# The attempt's own status, as stored on the turn: an interrupted turn holds a partial attempt.
ATTEMPT_STATUS = {
    "complete": "complete",
    "interrupted": "partial",
    "cancelled": "cancelled",
    "failed": "failed",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """The answer of ``claim_lease``: ``result`` is claimed, held, stale or missing."""

    result: str
    token: str = ""
    previous_status: str = ""
    stop_requested: bool = False


def encode(data: dict[str, Any]) -> str:
    return orjson.dumps(data).decode()


class TurnWriter:
    """Appends to one turn's stream under one fencing token; every call is checked by Lua."""

    def __init__(
        self,
        scripts: Scripts,
        keys: Keys,
        metrics: Metrics,
        conversation_id: str,
        turn_id: str,
        *,
        max_events: int,
        lease_ttl_ms: int,
        retention_ms: int,
        tombstone_ms: int,
    ) -> None:
        self._scripts = scripts
        self._metrics = metrics
        self._turn = keys.turn(conversation_id, turn_id)
        self._lease = keys.lease(conversation_id, turn_id)
        self._events = keys.events(conversation_id, turn_id)
        self._tombstone = keys.tombstone(conversation_id, turn_id)
        self._conversation_turns = keys.conversation_turns(conversation_id)
        self._max_events = max_events
        self._lease_ttl_ms = lease_ttl_ms
        self._retention_ms = retention_ms
        self._tombstone_ms = tombstone_ms
        self.token = ""
        self._appended = 0  # events appended under this token
        self._valid_until = 0.0  # (monotonic) the lease lasts at least this long

    def _renewed(self, since: float) -> None:
        self._valid_until = since + self._lease_ttl_ms / 1000

    async def claim(self, owner: str, attempt: int) -> Claim:
        since = time.monotonic()
        reply = await self._scripts(
            "claim_lease", [self._turn, self._lease], [owner, self._lease_ttl_ms, attempt]
        )
        if reply[0] == "claimed":
            self.token = reply[1]
            self._appended = 0
            self._renewed(since)
            return Claim("claimed", reply[1], reply[2], reply[3] == "1")
        return Claim(reply[0])

    async def renew(self) -> bool:
        """Extend the lease; True when the user asked to stop. Raises ``FencedWrite`` if lost."""
        since = time.monotonic()
        reply = await self._scripts(
            "renew_lease", [self._lease, self._turn], [self.token, self._lease_ttl_ms]
        )
        self._renewed(since)
        return int(reply) == 2

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script that is safe to send twice, again and again while the connection fails
        and the lease is still valid; then raise the connection's error."""
        delay = RETRY_BACKOFF_MIN_S
        failures = 0
        while True:
            try:
                reply = await self._scripts(name, keys, args)
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

    async def release(self) -> bool:
        """Give the lease up now; False when it was no longer this writer's."""
        return int(await self._scripts("release_lease", [self._lease], [self.token])) == 1

    async def append(self, events: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Append events in order; returns their entry ids.

        Raises FencedWrite (lease lost), StopRequested (stop pressed) or StreamFull.
        """
        args: list[Any] = [self.token, self._max_events, self._appended]
        for kind, data in events:
            args += (kind, encode(data))
        began = time.perf_counter()
        ids: list[str] = await self._call(
            "append_events", [self._lease, self._events, self._turn], args
        )
        self._appended += len(events)
        self._metrics.append_seconds.observe(time.perf_counter() - began)
        return ids

    async def finish(
        self,
        *,
        record: dict[str, Any],
        status: str,
        reason: str | None,
        text: str,
        promote: bool,
        base: str,
        before_end: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> int:
        """Write the last events and the ``end`` sentinel, set the turn at rest, drop the lease.

        ``record`` is the attempt's record (n, strategy, ...); returns the promotion result:
        1 promoted to canonical, 0 not asked, -1 refused because the canonical attempt changed.
        """
        attempt = int(record["n"])
        final = {**record, "status": ATTEMPT_STATUS[status], "reason": reason}
        events = [*before_end, ("end", {"attempt": attempt, "status": status, "reason": reason})]
        args: list[Any] = [
            self.token,
            attempt,
            status,
            encode(final),
            text,
            self._retention_ms,
            self._tombstone_ms,
            "1" if promote else "0",
            base,
        ]
        for kind, data in events:
            args += (kind, encode(data))
        keys = [self._turn, self._lease, self._events, self._tombstone, self._conversation_turns]
        reply = await self._call("finish_attempt", keys, args)
        self._metrics.turns_finished.labels(status).inc()
        return int(reply[0])
