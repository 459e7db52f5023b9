"""The tool-call ledger: claim a call before acting, so a re-issued turn never pays twice.

A slot is (conversation, turn, tool name, ordinal of that tool's calls in the attempt): a
regenerated or continued attempt that makes the same calls in the same order meets the same
slots. The claim (``claim_tool.lua``) answers what the caller may do; the downstream call
carries ``Idempotency-Key`` = the first 32 hex digits of SHA-256(slot, arguments' fingerprint).

What a caller does with each answer:

=================  ==========================================================================
claimed            run the call; store its result or error (``finish_tool.lua``)
completed, failed  replay the stored outcome; nothing runs
in_flight          wait with backoff up to ``BROKER_TOOL_IN_FLIGHT_WAIT_S``, then fail the turn
                   (``in_flight_timeout``)
args_mismatch      a write fails the turn; a read runs (outside the ledger)
reclaimed          the holder's lease expired: a read re-runs, a keyed write re-sends with the
                   same key, an unkeyed write is stored as ``unknown_outcome`` and fails the turn
=================  ==========================================================================

A call whose tool's rule asks for a person's approval is first parked
(``request_approval.lua``): the slot is ``awaiting_approval`` and the call waits (the outcome's
``source`` is ``awaiting``); a decision makes it ``approved`` (the next claim answers
``claimed``: it runs once) or ``failed`` with ``approval_denied`` (replayed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.approval_rules import new_approval_id, now_ms
from broker.canonical import fingerprint
from broker.deps import Deps
from broker.errors import FencedWrite
from broker.keys import Keys
from broker.metrics import Metrics
from broker.periodic import Periodic
from broker.scripts import ApprovalReply
from broker.settings import Settings
from broker.tools import Tool, ToolError, ToolRegistry, invoke
from broker.vocabulary import unscoped

log = logging.getLogger("broker.ledger")

KEYED_RESENDS = 2  # a keyed write whose outcome is unknown is re-sent (same key) this often


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    conversation_id: str
    turn_id: str
    tool: str
    ordinal: int

    def key(self, keys: Keys) -> str:
        return keys.tool_slot(self.conversation_id, self.turn_id, self.tool, self.ordinal)

    def idempotency_key(self, args_fingerprint: str) -> str:
        """32 hex digits naming this call (slot and arguments) for the downstream."""
        text = "\x00".join(
            (self.conversation_id, self.turn_id, self.tool, str(self.ordinal), args_fingerprint)
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """The ledger's answer; ``payload`` is the stored result or error when there is one."""

    state: str
    token: str = ""
    payload: Any = None
    wait_ms: int = 0


class Ledger:
    """The Lua-backed ledger operations."""

    def __init__(self, deps: Deps) -> None:
        self._redis = deps.redis
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._retention_ms = deps.settings.index_ttl_ms
        # Told (conversation_id, turn_id, approval_id) each time an approval request is met:
        # the approval webhook's watch (broker.webhooks).
        self.on_approval_requested: Callable[[str, str, str], Awaitable[None]] | None = None

    async def claim(
        self, slot: Slot, args_fingerprint: str, row: dict[str, Any], lease_token: str = ""
    ) -> Claim:
        """Claim the slot; with ``lease_token``, only while that turn lease is current."""
        keys = self._keys
        claim = await self._scripts.claim_tool(
            slot=slot.key(keys),
            slots=keys.tool_slots(slot.conversation_id, slot.turn_id),
            lease=keys.lease(slot.conversation_id, slot.turn_id),
            fingerprint=args_fingerprint,
            lease_ms=self._settings.tool_lease_ms,
            owner="broker",
            retention_ms=self._retention_ms,
            row=orjson.dumps(row).decode(),
            lease_token=lease_token,
        )
        state = claim.result
        if state == "fenced":
            raise FencedWrite("the turn's lease was lost before its tool call")
        self._metrics.ledger_claims.labels(state).inc()
        if state in ("claimed", "reclaimed"):
            return Claim(state, token=claim.token)
        if state in ("completed", "failed"):
            return Claim(state, payload=orjson.loads(claim.payload))
        if state == "in_flight":
            return Claim(state, wait_ms=claim.wait_ms)
        return Claim(state)

    async def request_approval(
        self,
        slot: Slot,
        args_fingerprint: str,
        row: dict[str, Any],
        lease_token: str,
        ttl_s: float,
        request: dict[str, Any],
    ) -> ApprovalReply:
        """Park the slot for a person's approval (``request_approval.lua``): ``requested`` or
        ``pending`` (wait), ``decided`` (claim it), ``args_mismatch``; raises FencedWrite."""
        keys = self._keys
        approval_id = new_approval_id()
        now = now_ms()
        expires_ms = now + int(ttl_s * 1000)
        reply = await self._scripts.request_approval(
            slot=slot.key(keys),
            slots=keys.tool_slots(slot.conversation_id, slot.turn_id),
            lease=keys.lease(slot.conversation_id, slot.turn_id),
            approval=keys.approval(slot.conversation_id, slot.turn_id, approval_id),
            args=[
                args_fingerprint,
                "broker",
                max(self._retention_ms, int(ttl_s * 1000) + self._retention_ms),
                orjson.dumps(row).decode(),
                lease_token,
                approval_id,
                expires_ms,
                orjson.dumps(request).decode(),
                now,
            ],
        )
        if reply.result == "fenced":
            raise FencedWrite("the turn's lease was lost before its tool call")
        if reply.result in ("requested", "pending"):
            # Met again too (a regenerate, a takeover): an index entry a crash lost comes back,
            # so the sweep still finds the request.
            member = f"{slot.conversation_id} {slot.turn_id} {reply.approval_id}"
            await self._redis.zadd(self._keys.approval_expiry(), {member: reply.expires_ms})
        if reply.result == "requested":
            self._metrics.approvals_requested.inc()
        if reply.result in ("requested", "pending") and self.on_approval_requested is not None:
            await self.on_approval_requested(slot.conversation_id, slot.turn_id, reply.approval_id)
        return reply

    async def renew(self, slot: Slot, token: str, lease_ms: int | None = None) -> None:
        """Extend the claim's lease (``lease_ms=0`` releases it for the next claimer)."""
        ms = self._settings.tool_lease_ms if lease_ms is None else lease_ms
        await self._scripts.renew_tool(slot=slot.key(self._keys), token=token, lease_ms=ms)

    async def finish(self, slot: Slot, token: str, outcome: str, payload: Any) -> bool:
        """Store the outcome; False when fenced (a newer claim owns the slot, or it is done)."""
        return await self._scripts.finish_tool(
            slot=slot.key(self._keys),
            token=token,
            outcome=outcome,
            payload=orjson.dumps(payload).decode(),
        )

    async def abandon(self, conversation_id: str, turn_id: str, row: dict[str, Any]) -> None:
        """Record a call cut off while its arguments were arriving: never dispatched."""
        key = self._keys.tool_abandoned(conversation_id, turn_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, orjson.dumps(row))
            pipe.pexpire(key, self._retention_ms)
            await pipe.execute()

    async def rows(self, conversation_id: str, turn_id: str) -> list[dict[str, Any]]:
        """The ledger rows of a turn, for the audit, in claim order."""
        keys = self._keys
        slots = await rc.smembers(self._redis, keys.tool_slots(conversation_id, turn_id))
        rows: list[dict[str, Any]] = []
        for slot_key in slots:
            data = await rc.hgetall(self._redis, slot_key)
            if not data:
                continue
            row = orjson.loads(data.get("row", "{}"))
            row.update(
                {
                    "state": data.get("state"),
                    "fingerprint": data.get("fingerprint"),
                    "claims": int(data.get("token", 0)),
                    "reclaims": int(data.get("reclaims", 0)),
                    "claimed_ms": int(data.get("claimed_ms", 0)),
                    "finished_ms": int(data["finished_ms"]) if "finished_ms" in data else None,
                }
            )
            if "result" in data:
                row["result"] = orjson.loads(data["result"])
            if "error" in data:
                row["error"] = orjson.loads(data["error"])
            rows.append(row)
        rows.sort(key=lambda r: (r["claimed_ms"], r.get("tool", ""), r.get("ordinal", 0)))
        abandoned = await self._redis.lrange(keys.tool_abandoned(conversation_id, turn_id), 0, -1)
        rows += [orjson.loads(raw) for raw in abandoned]
        return rows


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What a dispatched call gave: a result or an error for the model, and whether the turn
    must fail (``fail_reason``). ``source`` says how: ran, replayed, or refused."""

    source: str
    result: Any = None
    error: dict[str, Any] | None = None
    fail_reason: str | None = None
    idempotency_key: str = ""
    approval: ApprovalReply | None = None  # source "awaiting": the request it waits on


class Dispatcher:
    """Runs tool calls through the ledger."""

    def __init__(
        self,
        registry: ToolRegistry,
        ledger: Ledger,
        http: httpx.AsyncClient,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self.registry = registry
        self.ledger = ledger
        self._http = http
        self._settings = settings
        self._metrics = metrics
        self._random = random.Random()

    async def dispatch(
        self, slot: Slot, arguments_text: str, row: dict[str, Any], lease_token: str = ""
    ) -> Outcome:
        """Run one call through the ledger (see the module docstring); ``lease_token`` is the
        caller's turn lease, checked by the claim. Raises FencedWrite when it is not current."""
        tool = self.registry.get(slot.tool)
        if tool is None:
            return _refused("unknown_tool", f"no tool named {slot.tool!r}")
        try:
            arguments = orjson.loads(arguments_text or "{}")
        except orjson.JSONDecodeError as exc:
            return _refused("invalid_arguments", f"arguments are not JSON: {exc}")
        problem = tool.validate(arguments)
        if problem is not None:
            return _refused("invalid_arguments", problem)
        tenant = unscoped(slot.conversation_id)[0]  # told to the endpoint, for its own checks
        args_fingerprint = fingerprint(arguments)
        key = slot.idempotency_key(args_fingerprint)
        row = {**row, "class": tool.kind, "arguments": arguments, "idempotency_key": key}
        if tool.approval.needs_approval(arguments):
            waiting = await self._request_approval(tool, slot, args_fingerprint, row, lease_token)
            if waiting is not None:
                return waiting
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.tool_in_flight_wait_s
        delay = 0.05
        while True:
            claim = await self.ledger.claim(slot, args_fingerprint, row, lease_token)
            if claim.state == "claimed":
                return await self._run(tool, slot, claim.token, arguments, key, tenant)
            if claim.state == "reclaimed":
                if tool.kind == "unkeyed_write":
                    return await self._unknown(
                        tool, slot, claim.token, key, "its previous run was cut off"
                    )
                return await self._run(tool, slot, claim.token, arguments, key, tenant)
            if claim.state == "completed":
                self._metrics.tool_calls.labels(tool.kind, "replayed").inc()
                return Outcome("replayed", result=claim.payload, idempotency_key=key)
            if claim.state == "failed":
                self._metrics.tool_calls.labels(tool.kind, "replayed").inc()
                error = claim.payload if isinstance(claim.payload, dict) else {}
                fail = "unknown_outcome" if error.get("code") == "unknown_outcome" else None
                return Outcome("replayed", error=error, fail_reason=fail, idempotency_key=key)
            if claim.state == "args_mismatch" and tool.kind == "read":
                return await self._run(tool, None, "", arguments, key, tenant)
            if claim.state in ("args_mismatch", "awaiting_approval"):
                return _not_claimed(claim.state, slot)
            # in_flight: someone runs it now; wait for its outcome, but not for ever.
            if loop.time() >= deadline:
                return Outcome(
                    "refused",
                    fail_reason="in_flight_timeout",
                    error={
                        "code": "in_flight_timeout",
                        "message": f"{slot.tool} #{slot.ordinal} is still running elsewhere",
                    },
                )
            pause = min(delay, claim.wait_ms / 1000, deadline - loop.time())
            await asyncio.sleep(max(pause, 0.001) * self._random.uniform(0.5, 1.0))
            delay = min(delay * 2, 1.0)

    async def _request_approval(
        self, tool: Tool, slot: Slot, args_fingerprint: str, row: dict[str, Any], token: str
    ) -> Outcome | None:
        """A call that needs a person: ``awaiting`` while it waits, None once it was decided
        (the claim that follows runs it once, or replays its refusal)."""
        settings = self._settings
        # Never past a turn's id: a later decision must still find its turn.
        longest_s = settings.stream_ttl + settings.tombstone_ttl
        ttl_s = min(tool.approval_ttl_s or settings.approval_ttl_s, longest_s)
        request = {"tool": tool.name, **row}
        answer = await self.ledger.request_approval(
            slot, args_fingerprint, row, token, ttl_s, request
        )
        if answer.result in ("requested", "pending"):
            return Outcome("awaiting", approval=answer, idempotency_key=row["idempotency_key"])
        return None

    async def _run(
        self,
        tool: Tool,
        slot: Slot | None,
        token: str,
        arguments: dict[str, Any],
        key: str,
        tenant: str | None,
    ) -> Outcome:
        heartbeat = None
        if slot is not None:
            claimed = slot
            heartbeat = Periodic(
                lambda: self._heartbeat(claimed, token),
                self._settings.tool_lease_ms / 3000,
                name=f"tool lease {slot.tool}",
            )
        try:
            result = await self._invoke(tool, arguments, key, tenant)
        except ToolError as exc:
            if not exc.outcome_known and tool.kind == "read":
                # A read that may or may not have answered: let the next call re-run it.
                if slot is not None:
                    await self.ledger.renew(slot, token, lease_ms=0)
                return Outcome(
                    "ran", error={"code": exc.code, "message": exc.message}, idempotency_key=key
                )
            if not exc.outcome_known:
                assert slot is not None
                return await self._unknown(tool, slot, token, key, exc.message)
            error = {"code": exc.code, "message": exc.message}
            if slot is not None:
                await self.ledger.finish(slot, token, "failed", error)
            self._metrics.tool_calls.labels(tool.kind, "error").inc()
            return Outcome("ran", error=error, idempotency_key=key)
        except asyncio.CancelledError:
            # Stopped mid-call: whether it acted is unknown. Record that before going, or the
            # slot would look in flight until its lease ran out.
            if slot is not None:
                if tool.kind == "read":
                    await asyncio.shield(self.ledger.renew(slot, token, lease_ms=0))
                else:
                    await asyncio.shield(
                        self._unknown(tool, slot, token, key, "the turn was stopped mid-call")
                    )
            raise
        finally:
            if heartbeat is not None:
                await heartbeat.stop()  # never re-raises: a stop must not be swallowed
        if slot is not None and not await self.ledger.finish(slot, token, "completed", result):
            log.warning(
                "tool %s #%d finished after its claim was taken over", slot.tool, slot.ordinal
            )
        self._metrics.tool_calls.labels(tool.kind, "ok").inc()
        return Outcome("ran", result=result, idempotency_key=key)

    async def _invoke(
        self, tool: Tool, arguments: dict[str, Any], key: str, tenant: str | None
    ) -> Any:
        """Call the tool; a keyed write whose outcome is unknown is re-sent with the same key."""
        sends = 1 + (KEYED_RESENDS if tool.kind == "keyed_write" else 0)
        for send in range(sends):
            try:
                return await invoke(tool, arguments, key, self._http, tenant)
            except ToolError as exc:
                if exc.outcome_known or send == sends - 1:
                    raise
                await asyncio.sleep(0.05 * (send + 1))
        raise AssertionError("unreachable")

    async def _unknown(self, tool: Tool, slot: Slot, token: str, key: str, why: str) -> Outcome:
        error = {
            "code": "unknown_outcome",
            "message": f"{tool.name} may or may not have taken effect ({why}); it is not re-sent",
        }
        await self.ledger.finish(slot, token, "failed", error)
        self._metrics.tool_calls.labels(tool.kind, "unknown_outcome").inc()
        return Outcome("ran", error=error, fail_reason="unknown_outcome", idempotency_key=key)

    async def _heartbeat(self, slot: Slot, token: str) -> bool:
        """Renew the call's claim; False once it was taken over."""
        try:
            await self.ledger.renew(slot, token)
        except FencedWrite:
            return False
        except (RedisError, OSError) as exc:
            # Keep trying: the call's outcome must not be lost to a renewal blip.
            log.warning("tool lease renewal failed: %s", exc)
        return True


def _not_claimed(state: str, slot: Slot) -> Outcome:
    """A write held with other arguments fails the turn; a call that waits for a person (its
    tool's rule changed since) is refused: it never runs unapproved."""
    if state == "awaiting_approval":
        return _refused("awaiting_approval", f"{slot.tool} waits for an approval")
    return Outcome(
        "refused",
        fail_reason="args_mismatch",
        error={
            "code": "args_mismatch",
            "message": f"{slot.tool} #{slot.ordinal} was called with other arguments "
            "before; a write is not re-run with new ones",
        },
    )


def _refused(code: str, message: str) -> Outcome:
    """Not dispatched: the model gets the error and may correct itself."""
    return Outcome("refused", error={"code": code, "message": message})
