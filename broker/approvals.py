"""Deciding tool approvals: the first decision wins, from any device; an expired one is denied.

A tool call that needs a person's approval parks its ledger slot (``request_approval.lua``) and
its attempt (``park_attempt.lua``): the turn is ``awaiting_approval`` and no worker holds it.
A decision is one compare-and-set (``decide_approval.lua``): it is stored on the approval, the
slot becomes approved (the next claim runs the call once) or declined (every later claim
replays the refusal), an ``approval_decision`` event goes on the stream, and the turn is queued
again when nothing else of it waits; this module then puts its job on the queue.

Three kinds of decision, counted apart: a person's (``person``), the expiry's (``expiry``: a
request past ``BROKER_APPROVAL_TTL_S``, or its tool's ``approval_ttl_s``, is denied with reason
``expired``, by :meth:`Approvals.sweep` or when a person's decision comes too late), and a
stop's (``stop``: the turn was stopped while it waited; the slot is dropped, so a regenerate asks
again). The clock is :func:`broker.approval_rules.now_ms`, a seam tests move.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from broker import redis_calls as rc
from broker.approval_rules import (
    APPROVAL_ID_PATTERN,
    EXPIRED,
    STOPPED,
    declined_error,
    now_ms,
)
from broker.deps import Deps
from broker.errors import NotFound

log = logging.getLogger("broker.approvals")

SWEEP_BATCH = 100  # expired approvals decided per sweep call

Enqueue = Callable[[str, str, int], Awaitable[None]]


@dataclasses.dataclass(frozen=True, slots=True)
class Decided:
    """The decision that stands on an approval, and whether this call made it."""

    approval_id: str
    decision: str
    reason: str | None
    by: str
    new: bool  # this call decided it (False: an earlier decision stands)

    def shown(self) -> dict[str, Any]:
        """The decision as the approvals route answers it."""
        return {
            "approval_id": self.approval_id,
            "decision": self.decision,
            "reason": self.reason,
            "by": self.by,
        }


class Approvals:
    """Decisions on a turn's approvals; ``enqueue`` puts a resumed turn's job on the queue."""

    def __init__(self, deps: Deps, enqueue: Enqueue) -> None:
        self._deps = deps
        self._redis = deps.redis
        self._keys = deps.keys
        self._metrics = deps.metrics
        self._enqueue = enqueue

    async def decide(
        self,
        conversation_id: str,
        turn_id: str,
        approval_id: str,
        decision: str,
        reason: str | None,
        by: str = "person",
    ) -> Decided:
        """Decide once (404 for an unknown approval). A person's decision that comes after the
        approval expired is the expiry's: denied, reason ``expired``."""
        if not APPROVAL_ID_PATTERN.fullmatch(approval_id):
            raise NotFound(f"unknown approval {approval_id[:80]!r}")
        keys = self._keys
        approval_key = keys.approval(conversation_id, turn_id, approval_id)
        slot, expires, requested = await rc.hmget(
            self._redis, approval_key, ["slot", "expires_ms", "requested_ms"]
        )
        if slot is None:
            raise NotFound(f"unknown approval {approval_id!r} of turn {turn_id!r}")
        now = now_ms()
        if by == "person" and expires is not None and now >= int(expires):
            decision, reason, by = "deny", EXPIRED, "expiry"
        reply = await self._deps.scripts.decide_approval(
            keys=[
                approval_key,
                slot,
                keys.turn(conversation_id, turn_id),
                keys.events(conversation_id, turn_id),
                keys.approvals_waiting(conversation_id, turn_id),
                keys.lease(conversation_id, turn_id),
            ],
            approval_id=approval_id,
            decision=decision,
            reason=reason or "",
            by=by,
            now_ms=now,
            denied_error=orjson.dumps(declined_error(reason, by)).decode(),
        )
        if reply.result == "missing":
            raise NotFound(f"unknown approval {approval_id!r} of turn {turn_id!r}")
        decided = Decided(
            approval_id, reply.decision, reply.reason or None, reply.by, reply.result == "decided"
        )
        if not decided.new:
            return decided
        self._metrics.approvals_decided.labels(decided.decision, decided.by).inc()
        if requested is not None:
            waited_s = max(0.0, (now - int(requested)) / 1000)
            self._metrics.approval_decision_seconds.labels(decided.by).observe(waited_s)
        member = f"{conversation_id} {turn_id} {approval_id}"
        await self._redis.zrem(keys.approval_expiry(), member)
        log.info("turn %s: approval %s decided %s (%s)", turn_id, approval_id, decided.decision, by)
        if reply.resumed:
            await self._enqueue(conversation_id, turn_id, reply.attempt)
        return decided

    async def stop_waiting(self, conversation_id: str, turn_id: str) -> None:
        """The turn is being stopped: its approvals still waiting are decided by the stop."""
        waiting = await rc.smembers(
            self._redis, self._keys.approvals_waiting(conversation_id, turn_id)
        )
        for approval_id in sorted(waiting):
            await self.decide(conversation_id, turn_id, approval_id, "deny", STOPPED, by="stop")

    async def sweep(self) -> int:
        """Deny the approvals whose time ran out (reason ``expired``); returns how many, and
        counts those still pending (``broker_approvals_pending``)."""
        index = self._keys.approval_expiry()
        due = await self._redis.zrangebyscore(index, "-inf", now_ms(), start=0, num=SWEEP_BATCH)
        expired = 0
        for raw in due:
            member = raw.decode() if isinstance(raw, bytes) else str(raw)
            conversation_id, turn_id, approval_id = [*member.split(" "), "", "", ""][:3]
            try:
                decided = await self.decide(
                    conversation_id, turn_id, approval_id, "deny", EXPIRED, by="expiry"
                )
                expired += decided.new
            except NotFound:
                pass  # gone with its turn
            await self._redis.zrem(index, member)
        self._metrics.approvals_pending.set(await self._redis.zcard(index))
        return expired
