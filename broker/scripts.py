"""The Lua scripts of ``broker/lua/``: loaded once, called through typed methods.

Each script is one atomic operation whose contract is written in its file header. Each has one
method here, named after it, that takes the header's KEYS and ARGV by name and returns its reply
decoded into a frozen type: the only place that knows a reply's positions. The error replies of
the header (``FENCED``, ``CANCELLED``, ``STREAM_FULL``) are raised as the broker's exceptions.
Calling a script by name (``await scripts("claim_lease", keys, args)``) is the raw form, for
tests of a script's contract itself, and for the Durable Streams service, whose ``ds_*``
scripts are loaded here with the others but typed in their own room
(:mod:`broker.durable_store.scripts`).

redis-py's ``register_script`` sends EVALSHA and reloads the script by itself after
``NOSCRIPT`` (a restarted or failed-over server), so callers never see that case.

With ``replica_acks`` (``BROKER_REPLICA_ACKS``), each call is followed by ``WAIT <replica_acks>
<wait_ms>`` on the same connection, in the same round trip: the call returns once that many
replicas have its write (turn state, events, leases, the tool ledger), or once the wait is over,
as Redis's ``WAIT`` never undoes a write. A wait that ends short is reported to ``on_short``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any, Final, Literal

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from broker.connection import as_cluster
from broker.errors import BrokerError, FencedWrite, StopRequested, StreamFull

Event = tuple[str, str]  # (event type, JSON data) as a script appends it

# Every script of lua/, by name (a list of words: one line holds several).
NAMES = tuple(
    """
    create_turn claim_lease renew_lease append_events finish_attempt promote_attempt
    start_attempt cancel_turn take_retry_budget claim_tool renew_tool finish_tool
    request_approval decide_approval park_attempt admit_turn renew_viewer release_viewer
    release_lease take_webhook seek_sequence ds_create ds_append ds_delete ds_fork_ref
    ds_touch ds_read ds_sub_put ds_sub_delete ds_sub_link ds_sub_mark ds_sub_claim ds_sub_ack
    """.split()  # noqa: SIM905
)


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    """``admit_turn``: whether the tenant may start the attempt, and if not, when and why."""

    admitted: bool
    retry_after_ms: int = 0
    reason: str = ""  # "rate" or "streams" when refused


@dataclasses.dataclass(frozen=True, slots=True)
class Created:
    """``create_turn``: ``result`` is created, exists, conflict or expired."""

    result: Literal["created", "exists", "conflict", "expired"]
    stream_id: str = ""
    status: str = ""
    attempt: int = 0
    created_ms: int = 0
    enqueued: bool = False  # (exists only) the turn's first job went on the queue


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """``claim_lease``: ``result`` is claimed, held, stale or missing."""

    result: Literal["claimed", "held", "stale", "missing"]
    token: str = ""
    previous_status: str = ""  # (claimed) "streaming" means a takeover
    stop_requested: bool = False  # (claimed) a stop was requested meanwhile


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """``finish_attempt``: 1 promoted, 0 not asked (or already finished), -1 refused."""

    promotion: int  # (the reply's entry ids follow; no caller needs them)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """The answer of ``cancel_turn``, ``start_attempt`` and ``promote_attempt``: a ``result``
    word and the one value that comes with it (an attempt, a status, a reason), as text."""

    result: str
    value: str = ""

    @property
    def attempt(self) -> int:
        return int(self.value)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolClaim:
    """``claim_tool``: ``result`` is claimed, reclaimed, completed, failed, in_flight,
    args_mismatch, awaiting_approval or fenced."""

    result: str
    token: str = ""  # claimed, reclaimed
    payload: str = ""  # completed, failed: the stored JSON; args_mismatch: the fingerprint
    wait_ms: int = 0  # in_flight: the holder's lease left


@dataclasses.dataclass(frozen=True, slots=True)
class ApprovalReply:
    """``request_approval`` (requested, pending, decided, args_mismatch, fenced),
    ``decide_approval`` (decided, stands, missing) and ``park_attempt`` (parked, decided, stop):
    the approval's id and expiry, or its decision, or the slot's state."""

    result: str
    approval_id: str = ""
    expires_ms: int = 0
    decision: str = ""
    reason: str = ""
    by: str = ""
    state: str = ""  # request_approval decided: the slot's state; args_mismatch: fingerprint
    resumed: bool = False  # decide_approval decided: the turn was queued again
    attempt: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookTake:
    """``take_webhook``: ``take`` (send ``body`` to ``url`` now; ``tries`` failed before),
    ``wait`` (held for ``wait_ms`` more by a send in flight or a backoff) or ``sent`` (the
    attempt's notification was delivered already)."""

    result: Literal["take", "wait", "sent"]
    tries: int = 0
    body: str = ""
    url: str = ""
    ended_ms: int = 0
    wait_ms: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SeekReply:
    """``seek_sequence``: where a Responses read resumes (``done``), or where a walk stopped at
    its bound (the next call starts there)."""

    after: str  # the entry id to read after ("0-0": the start)
    base: int  # the sequence number of the first expansion of the entry that follows it
    done: bool


def _text(reply: Sequence[Any], index: int) -> str:
    return "" if len(reply) <= index or reply[index] is None else str(reply[index])


INCLUDE: Final = re.compile(r"^--! include (_[a-z_]+)$", re.M)


def _lua_file(name: str) -> str:
    return resources.files("broker").joinpath("lua", f"{name}.lua").read_text("utf-8")


def expand(text: str, part: Callable[[str], str]) -> str:
    """``text`` with each ``--! include _<part>`` line replaced by that part's text (one level:
    a part includes nothing). Redis scripts cannot include each other; the parts
    (``broker/lua/_*.lua``) hold what several scripts share, functions only."""
    return INCLUDE.sub(lambda found: part(found.group(1)).rstrip("\n"), text)


_ERRORS: Final[tuple[tuple[str, type[BrokerError]], ...]] = (
    ("FENCED", FencedWrite),
    ("CANCELLED", StopRequested),
    ("STREAM_FULL", StreamFull),
)


def broker_error(exc: ResponseError) -> Exception:
    """The broker's exception for a script's error reply (see the module), else ``exc``."""
    message = str(exc)
    for word, kind in _ERRORS:
        if word in message:
            return kind(message.split(word, 1)[1].strip())
    return exc


def script_source(name: str) -> str:
    """The text of ``broker/lua/<name>.lua``, its included parts in place."""
    return expand(_lua_file(name), _lua_file)


class Scripts:
    """Registered scripts for one Redis client."""

    def __init__(
        self,
        redis: Redis,
        *,
        replica_acks: int = 0,
        wait_ms: int = 500,
        on_short: Callable[[str, int], None] | None = None,
    ) -> None:
        self.redis = redis
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(script_source(name)) for name in NAMES
        }
        self.replica_acks = replica_acks
        self._wait_ms = wait_ms
        self._on_short = on_short

    async def load(self) -> None:
        """Load every script now, so a broken script fails the start, not the first turn."""
        for script in self._scripts.values():
            script.sha = await self.redis.script_load(script.script)

    async def loaded(self) -> bool:
        """Whether the server still has every script cached (readiness)."""
        shas = [script.sha for script in self._scripts.values()]
        found = await self.redis.script_exists(*shas)
        return all(found)

    async def ready(self) -> None:
        """Readiness: Redis answers, and has every script (loaded again if it lost them).
        Raises whatever Redis raised."""
        await self.redis.ping()
        if not await self.loaded():
            await self.load()

    async def __call__(
        self, name: str, keys: list[str], args: list[Any], *, replicated: bool = True
    ) -> Any:
        """Run script ``name``; with ``replicated`` off, without waiting for the replicas (for
        a script whose writes are a cache)."""
        try:
            if self.replica_acks > 0 and replicated:
                return await self._call_replicated(name, keys, args)
            return await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            mapped = broker_error(exc)
            if mapped is exc:
                raise
            raise mapped from None

    def registered(self, name: str) -> AsyncScript:
        """Script ``name`` as registered (its source and SHA), for a caller that pipelines it."""
        return self._scripts[name]

    async def _call_replicated(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA, then WAIT on the same connection (WAIT counts the replicas that have this
        connection's writes): one pipeline, which a cluster sends to the node of the keys."""
        script = self._scripts[name]
        cluster = as_cluster(self.redis)
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                # As a raw command: a cluster pipeline refuses its ``evalsha`` method (not the
                # command, whose keys it routes like any other).
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                wait = ("WAIT", self.replica_acks, self._wait_ms)
                if cluster is not None:
                    node = cluster.get_node_from_key(keys[0])
                    pipe.execute_command(*wait, target_nodes=node)
                else:
                    pipe.execute_command(*wait)
                reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 1:
                # A server that lost its scripts (restarted, failed over): load, send again.
                script.sha = await self.redis.script_load(script.script)
                continue
            break
        if isinstance(reply, Exception):
            raise reply
        replicas = acked if isinstance(acked, int) else 0
        if replicas < self.replica_acks and self._on_short is not None:
            self._on_short(name, replicas)
        return reply

    # One typed method per script; the KEYS and ARGV are those of the script's header.

    async def admit_turn(
        self,
        *,
        rate: str,
        live: str,
        rate_per_s: float,
        burst: int,
        cost: int,
        max_live: int,
        member: str,
        slot_ttl_ms: int,
    ) -> Admitted:
        reply = await self(
            "admit_turn", [rate, live], [rate_per_s, burst, cost, max_live, member, slot_ttl_ms]
        )
        if int(reply[0]) == 1:
            return Admitted(True)
        return Admitted(False, int(reply[1]), _text(reply, 2))

    async def create_turn(
        self,
        *,
        turn: str,
        tombstone: str,
        conversation_turns: str,
        fingerprint: str,
        stream_id: str,
        conversation_id: str,
        turn_id: str,
        request: str,
        session: str,
        record: str,
        response_format: str,
        notify: str = "",
    ) -> Created:
        reply = await self(
            "create_turn",
            [turn, tombstone, conversation_turns],
            [
                fingerprint,
                stream_id,
                conversation_id,
                turn_id,
                request,
                session,
                record,
                response_format,
                notify,
            ],
        )
        result = str(reply[0])
        if result not in ("created", "exists"):
            return Created(result)  # type: ignore[arg-type]  # conflict or expired
        return Created(
            result,  # type: ignore[arg-type]
            stream_id=str(reply[1]),
            status=str(reply[2]),
            attempt=int(reply[3]),
            created_ms=int(reply[4]),
            enqueued=_text(reply, 5) == "1",
        )

    async def claim_lease(
        self, *, turn: str, lease: str, events_key: str, owner: str, ttl_ms: int, attempt: int
    ) -> Claim:
        reply = await self("claim_lease", [turn, lease, events_key], [owner, ttl_ms, attempt])
        result = str(reply[0])
        if result == "claimed":
            return Claim("claimed", str(reply[1]), _text(reply, 2), _text(reply, 3) == "1")
        return Claim(result)  # type: ignore[arg-type]  # held, stale or missing

    async def renew_lease(self, *, lease: str, turn: str, token: str, ttl_ms: int) -> bool:
        """True when the user asked to stop. Raises ``FencedWrite`` when the lease is lost."""
        return int(await self("renew_lease", [lease, turn], [token, ttl_ms])) == 2

    async def release_lease(self, *, lease: str, token: str) -> bool:
        """False when the lease was no longer this token's."""
        return int(await self("release_lease", [lease], [token])) == 1

    async def append_events(
        self,
        *,
        lease: str,
        events_key: str,
        turn: str,
        token: str,
        max_events: int,
        appended: int,
        events: Sequence[Event],
    ) -> list[str]:
        """The events' entry ids. Raises FencedWrite, StopRequested or StreamFull."""
        args: list[Any] = [token, max_events, appended]
        for kind, data in events:
            args += (kind, data)
        ids = await self("append_events", [lease, events_key, turn], args)
        return [str(entry_id) for entry_id in ids]

    async def finish_attempt(
        self,
        *,
        turn: str,
        lease: str,
        events_key: str,
        tombstone: str,
        conversation_turns: str,
        token: str,
        attempt: int,
        status: str,
        record: str,
        text: str,
        ttl_ms: int,
        tombstone_ms: int,
        promote: bool,
        base: str,
        events: Sequence[Event],
    ) -> Finished:
        """Raises ``FencedWrite`` when the lease is lost."""
        args: list[Any] = [
            token,
            attempt,
            status,
            record,
            text,
            ttl_ms,
            tombstone_ms,
            "1" if promote else "0",
            base,
        ]
        for kind, data in events:
            args += (kind, data)
        reply = await self(
            "finish_attempt", [turn, lease, events_key, tombstone, conversation_turns], args
        )
        return Finished(int(reply[0]))

    async def start_attempt(self, *, turn: str, events_key: str, strategy: str) -> Outcome:
        """``started`` (value: the attempt), ``busy`` (the status), ``not_allowed`` (the
        reason) or ``missing``."""
        reply = await self("start_attempt", [turn, events_key], [strategy])
        return Outcome(str(reply[0]), _text(reply, 1))

    async def cancel_turn(
        self,
        *,
        turn: str,
        events_key: str,
        tombstone: str,
        conversation_turns: str,
        lease: str,
        ttl_ms: int,
        tombstone_ms: int,
    ) -> Outcome:
        """``cancelled`` or ``signalled`` (value: the attempt), ``final`` (the status) or
        ``missing``."""
        reply = await self(
            "cancel_turn",
            [turn, events_key, tombstone, conversation_turns, lease],
            [ttl_ms, tombstone_ms],
        )
        return Outcome(str(reply[0]), _text(reply, 1))

    async def promote_attempt(self, *, turn: str, attempt: int, expected: str) -> Outcome:
        """``promoted`` (value: the attempt), ``conflict`` (the current canonical attempt, ""
        for none), ``not_allowed`` (the reason) or ``missing``."""
        reply = await self("promote_attempt", [turn], [attempt, expected])
        return Outcome(str(reply[0]), _text(reply, 1))

    async def take_retry_budget(
        self, *, budget_key: str, budget: int, window_ms: int, member: str
    ) -> bool:
        """True when the retry may go ahead."""
        return bool(int(await self("take_retry_budget", [budget_key], [budget, window_ms, member])))

    async def claim_tool(
        self,
        *,
        slot: str,
        slots: str,
        lease: str,
        fingerprint: str,
        lease_ms: int,
        owner: str,
        retention_ms: int,
        row: str,
        lease_token: str,
    ) -> ToolClaim:
        reply = await self(
            "claim_tool",
            [slot, slots, lease],
            [fingerprint, lease_ms, owner, retention_ms, row, lease_token],
        )
        result = str(reply[0])
        if result in ("claimed", "reclaimed"):
            return ToolClaim(result, token=str(reply[1]))
        if result == "in_flight":
            return ToolClaim(result, wait_ms=int(reply[1]))
        return ToolClaim(result, payload=_text(reply, 1))

    async def renew_tool(self, *, slot: str, token: str, lease_ms: int) -> None:
        """Raises ``FencedWrite`` when the token is not current or the call not in flight."""
        await self("renew_tool", [slot], [token, lease_ms])

    async def finish_tool(self, *, slot: str, token: str, outcome: str, payload: str) -> bool:
        """False when fenced: the token is not current, or the outcome is already stored."""
        return str((await self("finish_tool", [slot], [token, outcome, payload]))[0]) == "ok"

    async def request_approval(
        self, *, slot: str, slots: str, lease: str, approval: str, args: Sequence[Any]
    ) -> ApprovalReply:
        """``args``: the header's ARGV, in order."""
        reply = await self("request_approval", [slot, slots, lease, approval], list(args))
        result = str(reply[0])
        if result in ("requested", "pending"):
            return ApprovalReply(result, _text(reply, 1), expires_ms=int(reply[2]))
        return ApprovalReply(result, state=_text(reply, 1))

    async def decide_approval(
        self,
        *,
        keys: Sequence[str],
        approval_id: str,
        decision: str,
        reason: str,
        by: str,
        now_ms: int,
        denied_error: str,
    ) -> ApprovalReply:
        """``keys``: approval, slot, turn, events, waiting set, lease (the header's order)."""
        args = [approval_id, decision, reason, by, now_ms, denied_error]
        reply = await self("decide_approval", list(keys), args)
        result = str(reply[0])
        if result == "missing":
            return ApprovalReply(result)
        decided = ApprovalReply(
            result,
            approval_id,
            decision=_text(reply, 1),
            reason=_text(reply, 2),
            by=_text(reply, 3),
        )
        if result == "decided":
            decided = dataclasses.replace(
                decided, resumed=_text(reply, 4) == "1", attempt=int(_text(reply, 5) or 0)
            )
        return decided

    async def park_attempt(
        self,
        *,
        turn: str,
        lease: str,
        waiting: str,
        approvals: Sequence[tuple[str, str]],
        token: str,
        attempt: int,
        record: str,
        text: str,
    ) -> ApprovalReply:
        """``approvals``: (approval hash, approval id) pairs. Raises ``FencedWrite``."""
        keys = [turn, lease, waiting, *(key for key, _ in approvals)]
        args = [token, attempt, record, text, *(ident for _, ident in approvals)]
        reply = await self("park_attempt", keys, args)
        return ApprovalReply(str(reply[0]))

    async def renew_viewer(self, *, viewer: str, holder: str, ttl_ms: int) -> bool:
        """False when the holder lost the viewer lock."""
        return int(await self("renew_viewer", [viewer], [holder, ttl_ms])) == 1

    async def release_viewer(self, *, viewer: str, holder: str) -> bool:
        return int(await self("release_viewer", [viewer], [holder])) == 1

    async def take_webhook(
        self,
        *,
        delivery: str,
        hold: str,
        sent: str,
        body: str,
        url: str,
        ended_ms: int,
        hold_ms: int,
        ttl_ms: int,
    ) -> WebhookTake:
        reply = await self(
            "take_webhook", [delivery, hold, sent], [body, url, ended_ms, hold_ms, ttl_ms]
        )
        if str(reply[0]) == "sent":
            return WebhookTake("sent")
        if str(reply[0]) == "wait":
            return WebhookTake("wait", wait_ms=int(reply[1]))
        return WebhookTake(
            "take", int(reply[1]), _text(reply, 2), _text(reply, 3), int(_text(reply, 4) or 0)
        )

    async def seek_sequence(
        self,
        *,
        events_key: str,
        checkpoints: str,
        starting_after: int,
        first: int,
        every: int,
        ttl_ms: int,
        limit: int,
        expansion: Mapping[str, int],
        resume: tuple[str, int] | None = None,
    ) -> SeekReply:
        """One bounded step of a seek (``resume``: where the last step stopped). Its writes are
        checkpoints, a cache: no wait for the replicas."""
        start, base = resume if resume is not None else ("", 0)
        table = [item for pair in expansion.items() for item in pair]
        reply = await self(
            "seek_sequence",
            [events_key, checkpoints],
            [starting_after, first, every, ttl_ms, limit, start, base, *table],
            replicated=False,
        )
        return SeekReply(str(reply[0]), int(reply[1]), int(reply[2]) == 1)
