"""Turns: the idempotent start of a generation, and its state."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Final

import orjson

from broker import redis_calls as rc
from broker.admission import Admission
from broker.approvals import Approvals, Decided
from broker.canonical import canonical_json, fingerprint
from broker.client_tools import check_client_tools, check_tool_messages
from broker.content import MAX_IMAGES, count_images, text_of
from broker.deps import Deps
from broker.errors import BadRequest, Conflict, Gone, NotAllowed, NotFound
from broker.jobs import JobQueue
from broker.providers import Providers
from broker.structured_output import format_kind
from broker.turn_records import (
    Attempt,
    AttemptRecord,
    StoredRequest,
    TurnHead,
    links,
    turn_state,
)

# The request models are imported from here by the doors, which came before the split.
from broker.turn_requests import WHOLE as WHOLE
from broker.turn_requests import AttemptRequest as AttemptRequest
from broker.turn_requests import CanonicalRequest as CanonicalRequest
from broker.turn_requests import Message as Message
from broker.turn_requests import TurnRequest as TurnRequest
from broker.turn_requests import WholeNumber as WholeNumber
from broker.turn_requests import stored_request
from broker.vocabulary import (
    FINAL_STATUSES,
    ID_PATTERN,
    AttemptStatus,
    TurnStatus,
    encode_turn_ref,
    scoped,
)
from broker.webhooks import Webhooks

log = logging.getLogger("broker.turns")

RESCUE_INTERVAL_MS = 1_000
# A stop waits this long for the running attempt to end before it answers, looking this often.
CANCEL_WAIT_S = 5.0
CANCEL_POLL_S = 0.02
# How long a read that showed an approval request looks for its turn to park, and how often: the
# attempt parks right after the model's message that asked (park_attempt.lua writes no event).
PARK_WAIT_S: Final = 2.0
PARK_LOOK_S: Final = 0.05
# An attempt that ended with these is a whole answer in the history (not flagged partial).
WHOLE_ANSWERS: Final = frozenset({AttemptStatus.COMPLETE, AttemptStatus.REQUIRES_ACTION})


class Turns:
    """Creating and reading turns."""

    def __init__(
        self,
        deps: Deps,
        providers: Providers,
        admission: Admission,
        jobs: JobQueue,
        webhooks: Webhooks | None = None,
        server_tools: frozenset[str] = frozenset(),
        asks_approval: bool = False,
    ) -> None:
        self._server_tools = server_tools  # names a client tool may not take
        # Whether a tool of this broker may wait for a person (its turns may park).
        self.asks_approval = asks_approval
        self._admission = admission
        self._jobs = jobs
        self._webhooks = webhooks
        self._redis = deps.redis
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._settings = deps.settings
        self._providers = providers
        self._metrics = deps.metrics
        self.approvals = Approvals(deps, self._resume)

    def _check_limits(self, request: TurnRequest) -> None:
        limit = self._settings.max_messages
        if len(request.messages) > limit:
            raise BadRequest(
                f"{len(request.messages)} messages is more than BROKER_MAX_MESSAGES={limit}",
                code="too_many_messages",
            )
        dumped = [m.model_dump() for m in request.messages]
        images = count_images(dumped)
        if images > MAX_IMAGES:
            raise BadRequest(
                f"{images} images is more than this broker takes in one request ({MAX_IMAGES})",
                code="too_many_images",
            )
        longest = max(len(text_of(m["content"])) for m in dumped)
        if longest > self._settings.max_message_chars:
            raise BadRequest(
                f"a message has {longest} characters, more than "
                f"BROKER_MAX_MESSAGE_CHARS={self._settings.max_message_chars}",
                code="message_too_long",
            )
        check_client_tools(request.client_tools, self._server_tools)
        check_tool_messages(dumped)
        provider = self._providers.get(request.provider)
        self._providers.model_for(provider, request.model)
        provider.validate_params(request.params)

    async def create(
        self, request: TurnRequest, tenant: str | None = None
    ) -> tuple[bool, dict[str, Any]]:
        """Start a turn, or find the one with the same ``turn_id``; True when it is new.

        ``tenant`` owns the turn (None: the broker runs open). Conversation, turn and session
        ids are the tenant's own: another tenant may use the same ones without meeting them.
        """
        self._check_limits(request)
        self._check_notify(request)
        turn_id = request.turn_id or f"t_{secrets.token_hex(16)}"
        conversation_id = scoped(tenant, request.conversation_id)
        body = stored_request(request, self._providers.get(request.provider).name)
        fp = fingerprint(body)
        keys = self._keys
        index_ttl_ms = self._settings.index_ttl_ms
        # A repeated request for an existing turn is a lookup: it takes nothing from the limits.
        admitted = not await self._redis.exists(keys.turn(conversation_id, turn_id))
        if admitted:
            await self._admission.admit(conversation_id, turn_id, 1)
        try:
            index = keys.turn_index(scoped(tenant, turn_id))
            claimed = await self._redis.set(index, conversation_id, nx=True, px=index_ttl_ms)
            if not claimed:
                owner = await self._redis.get(index)
                if owner is not None and owner != conversation_id:
                    raise Conflict(
                        f"turn {turn_id!r} exists with a different request", code="turn_conflict"
                    )
            session = scoped(tenant, request.session_id or request.conversation_id)
            return await self._create(request, conversation_id, turn_id, session, fp, body)
        finally:
            if admitted:
                # Frees the slot unless the turn is live (created now, or by a twin request).
                await self._admission.release_if_done(conversation_id, turn_id, 1)

    async def _create(
        self,
        request: TurnRequest,
        conversation_id: str,
        turn_id: str,
        session: str,
        fp: str,
        body: dict[str, Any],
    ) -> tuple[bool, dict[str, Any]]:
        keys = self._keys
        index_ttl_ms = self._settings.index_ttl_ms
        stream_id = f"st_{secrets.token_hex(16)}"
        record = {
            "n": 1,
            "strategy": "initial",
            "status": TurnStatus.QUEUED,
            "reason": None,
            "canonical": False,
            "base": "",
        }
        created = await self._scripts.create_turn(
            turn=keys.turn(conversation_id, turn_id),
            tombstone=keys.tombstone(conversation_id, turn_id),
            conversation_turns=keys.conversation_turns(conversation_id),
            fingerprint=fp,
            stream_id=stream_id,
            conversation_id=conversation_id,
            turn_id=turn_id,
            request=canonical_json(body).decode(),
            session=session,
            record=orjson.dumps(record).decode(),
            response_format=format_kind(request.response_format),
            notify=request.notify.url if request.notify is not None else "",
        )
        result = created.result
        if result == "expired":
            raise Gone(
                f"turn {turn_id!r} finished and expired; start a new turn with a new turn_id",
                code="expired",
            )
        if result == "conflict":
            raise Conflict(
                f"turn {turn_id!r} exists with a different request", code="turn_conflict"
            )
        stream_id, status, attempt = created.stream_id, created.status, created.attempt
        turn_ref = encode_turn_ref(conversation_id, turn_id)
        if result == "created":
            await self._redis.set(keys.stream_index(stream_id), turn_ref, px=index_ttl_ms)
            await self._enqueue(conversation_id, turn_id, attempt)
            self._metrics.turns_started.inc()
            log.info(
                "turn %s started in conversation %s, stream %s",
                turn_id,
                conversation_id,
                stream_id,
                extra={
                    "event": "turn_started",
                    "turn_id": turn_id,
                    "conversation_id": conversation_id,
                    "stream_id": stream_id,
                },
            )
        else:
            # The first request may still be between its two steps: make sure a reader finds
            # the stream before we hand out its id, and rescue a turn a crash left unqueued.
            await self._redis.set(keys.stream_index(stream_id), turn_ref, nx=True, px=index_ttl_ms)
            if status == TurnStatus.QUEUED and not created.enqueued:
                await self._rescue(conversation_id, turn_id, attempt)
            self._metrics.turns_deduplicated.inc()
        return result == "created", {
            "turn_id": turn_id,
            "conversation_id": request.conversation_id,
            "stream_id": stream_id,
            "status": status,
            "attempt": attempt,
            "links": links(turn_id, stream_id),
        }

    def _check_notify(self, request: TurnRequest) -> None:
        """A turn's ``notify.url``: 400 malformed, 422 off or a host not allowed."""
        if request.notify is None:
            return
        if self._webhooks is None:
            raise NotAllowed("this broker sends no completion webhooks", code="notify_not_allowed")
        self._webhooks.check(request.notify.url)

    async def _enqueue(
        self, conversation_id: str, turn_id: str, attempt: int, *, resumed: bool = False
    ) -> None:
        if self._webhooks is not None:
            # Before the job: the notification is in Redis before the attempt can end.
            await self._webhooks.watch(conversation_id, turn_id, attempt)
        await self._jobs.enqueue(conversation_id, turn_id, attempt, resumed=resumed)
        await self._redis.hset(self._keys.turn(conversation_id, turn_id), "enqueued", "1")

    async def _resume(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Queue the attempt of a turn a decision on its approvals resumed."""
        await self._enqueue(conversation_id, turn_id, attempt, resumed=True)

    async def _rescue(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Queue a turn that was created but never queued (a crash or a Redis blip between
        the two steps, answered 503); the client's retry or a look at the turn triggers it.

        The creating request may also simply not have queued it *yet*: a second job is harmless
        (the lease lets one worker run the turn) but pointless, so at most one rescue a second.
        """
        guard = self._keys.rescue(conversation_id, turn_id)
        if await self._redis.set(guard, "1", nx=True, px=RESCUE_INTERVAL_MS):
            log.warning("turn %s was created but not queued; queueing it now", turn_id)
            await self._enqueue(conversation_id, turn_id, attempt)

    async def _locate(self, turn_id: str, tenant: str | None) -> tuple[str, dict[str, str]]:
        """The turn's (scoped) conversation and stored hash; 404 unknown, 410 expired.

        Another tenant's turn is not found: the index is looked up under the caller's tenant.
        """
        if not ID_PATTERN.fullmatch(turn_id):
            raise NotFound(f"unknown turn {turn_id[:80]!r}")
        conversation_id = await rc.get(self._redis, self._keys.turn_index(scoped(tenant, turn_id)))
        if conversation_id is None:
            raise NotFound(f"unknown turn {turn_id!r}")
        meta = await rc.hgetall(self._redis, self._keys.turn(conversation_id, turn_id))
        if not meta:
            if await self._redis.exists(self._keys.tombstone(conversation_id, turn_id)):
                raise Gone(f"turn {turn_id!r} expired", code="expired")
            raise NotFound(f"unknown turn {turn_id!r}")  # being created right now, or never was
        return conversation_id, meta

    async def locate(self, turn_id: str, tenant: str | None) -> str:
        """The (scoped) conversation of the caller's turn ``turn_id``; 404 or 410 otherwise."""
        conversation_id, _ = await self._locate(turn_id, tenant)
        return conversation_id

    async def get(self, turn_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The turn's state: status, attempts and the canonical attempt's text."""
        conversation_id, meta = await self._locate(turn_id, tenant)
        if meta["status"] == TurnStatus.QUEUED and meta.get("enqueued") != "1":
            await self._rescue(conversation_id, turn_id, int(meta["attempt"]))
        waiting = None
        if meta["status"] == TurnStatus.AWAITING_APPROVAL:
            key = self._keys.approvals_waiting(conversation_id, turn_id)
            waiting = frozenset(await rc.smembers(self._redis, key))
        return turn_state(turn_id, conversation_id, meta, waiting)

    # The reads every door needs, typed: no door reads a turn's hash fields itself.

    async def find(self, turn_id: str, tenant: str | None) -> TurnHead | None:
        """The caller's turn ``turn_id`` in two round trips, or None (a malformed id, unknown,
        expired, or being created this instant); :meth:`get` says which, with its error."""
        if not ID_PATTERN.fullmatch(turn_id):
            return None
        conversation_id = await rc.get(self._redis, self._keys.turn_index(scoped(tenant, turn_id)))
        if conversation_id is None:
            return None
        stream_id, created_ms, raw = await rc.hmget(
            self._redis,
            self._keys.turn(conversation_id, turn_id),
            ["stream_id", "created_ms", "request"],
        )
        if stream_id is None or created_ms is None:
            return None
        request = StoredRequest.decode(raw)
        return TurnHead(turn_id, conversation_id, stream_id, int(created_ms), request)

    async def request(self, conversation_id: str, turn_id: str) -> StoredRequest:
        """The request the turn (of the scoped ``conversation_id``) was made with."""
        key = self._keys.turn(conversation_id, turn_id)
        return StoredRequest.decode(await rc.hget(self._redis, key, "request"))

    async def attempt_record(
        self, conversation_id: str, turn_id: str, attempt: int
    ) -> AttemptRecord | None:
        """Attempt ``attempt``'s record; None when the turn has no such attempt (or expired)."""
        key = self._keys.turn(conversation_id, turn_id)
        return AttemptRecord.decode(await rc.hget(self._redis, key, f"attempt:{attempt}"))

    async def attempt(self, conversation_id: str, turn_id: str, attempt: int) -> Attempt:
        """Attempt ``attempt``'s record and text, as stored when it ended (a continue's own
        text is what follows the partial it continued)."""
        key = self._keys.turn(conversation_id, turn_id)
        text, raw = await rc.hmget(self._redis, key, [f"text:{attempt}", f"attempt:{attempt}"])
        record = AttemptRecord.decode(raw)
        whole = text or ""
        own = whole
        if record is not None and record.continues:
            base = await rc.hget(self._redis, key, f"text:{record.continues}") or ""
            if own.startswith(base):
                own = own[len(base) :]
        return Attempt(record, whole, own)

    async def at_rest(self, conversation_id: str, turn_id: str, attempt: int) -> bool:
        """Whether the turn is at rest on ``attempt``: that attempt ended and no other is queued
        after it (an expired turn is at rest too)."""
        key = self._keys.turn(conversation_id, turn_id)
        status, current = await rc.hmget(self._redis, key, ["status", "attempt"])
        return status is None or (status in FINAL_STATUSES and current == str(attempt))

    async def waiting(self, conversation_id: str, turn_id: str) -> bool:
        """Whether the turn waits for a person (``awaiting_approval``: no worker holds it)."""
        key = self._keys.turn(conversation_id, turn_id)
        return await rc.hget(self._redis, key, "status") == TurnStatus.AWAITING_APPROVAL

    async def parks(
        self, conversation_id: str, turn_id: str, within_s: float = PARK_WAIT_S
    ) -> bool:
        """Whether the turn waits for a person now or within ``within_s``: a read that showed
        an approval request asks, and ends there once the turn parked (nothing comes until
        someone decides); False after ``within_s`` (the read asks again later)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + within_s
        while not await self.waiting(conversation_id, turn_id):
            if loop.time() >= until:
                return False
            await asyncio.sleep(PARK_LOOK_S)
        return True

    async def latest(self, client_conversation_id: str, tenant: str | None) -> str | None:
        """The id of the caller's conversation's newest turn, if it has one (none for a
        malformed id)."""
        if not ID_PATTERN.fullmatch(client_conversation_id):
            return None
        key = self._keys.conversation_turns(scoped(tenant, client_conversation_id))
        newest = await self._redis.zrevrange(key, 0, 0)
        return str(newest[0]) if newest else None

    async def text_so_far(self, conversation_id: str, turn_id: str, attempt: int) -> str:
        """The text ``attempt`` delivered so far: its deltas on the turn's stream, in order (a
        running attempt's text is stored on the turn only once it ends)."""
        key = self._keys.events(conversation_id, turn_id)
        parts: list[str] = []
        start = "-"
        while True:
            page = await rc.xrange(self._redis, key, start)
            if not page:
                return "".join(parts)
            for _entry_id, fields in page:
                if fields.get("e") == "delta":
                    data = orjson.loads(fields.get("d", "{}"))
                    if data.get("attempt") == attempt:
                        parts.append(str(data.get("text", "")))
            start = "(" + page[-1][0]

    async def start_attempt(
        self, turn_id: str, request: AttemptRequest, tenant: str | None = None
    ) -> dict[str, Any]:
        """Continue or regenerate a turn at rest; 409 while one runs, 422 when not allowed."""
        conversation_id, meta = await self._locate(turn_id, tenant)
        keys = self._keys
        # The attempt this will start, if it starts: its slot is taken first.
        expected = int(meta["attempt"]) + 1
        await self._admission.admit(conversation_id, turn_id, expected)
        try:
            started = await self._scripts.start_attempt(
                turn=keys.turn(conversation_id, turn_id),
                events_key=keys.events(conversation_id, turn_id),
                strategy=request.strategy,
            )
        finally:
            await self._admission.release_if_done(conversation_id, turn_id, expected)
        if started.result == "busy":
            raise Conflict(
                f"turn {turn_id!r} is {started.value}: wait for it, or stop it first",
                code="turn_busy",
            )
        if started.result == "not_allowed":
            raise NotAllowed(started.value, code="strategy_not_allowed")
        if started.result == "missing":
            raise Gone(f"turn {turn_id!r} expired", code="expired")
        attempt = started.attempt
        # The answer is the turn as this request left it, its new attempt queued (as a new
        # turn's answer is): read once the job is on the queue, it said `queued` or `streaming`
        # as a worker's timing fell. Until the job is queued no worker can change it, and a
        # turn left queued but not enqueued is rescued by the next read of its state.
        meta = await rc.hgetall(self._redis, keys.turn(conversation_id, turn_id))
        await self._enqueue(conversation_id, turn_id, attempt)
        log.info("turn %s: attempt %d (%s) queued", turn_id, attempt, request.strategy)
        return turn_state(turn_id, conversation_id, meta)

    async def decide(
        self, turn_id: str, approval_id: str, decision: str, reason: str | None, tenant: str | None
    ) -> Decided:
        """A person's decision on one of the caller's turn's approvals (the first one wins)."""
        conversation_id, _ = await self._locate(turn_id, tenant)
        return await self.approvals.decide(conversation_id, turn_id, approval_id, decision, reason)

    async def cancel(self, turn_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The stop button: idempotent; a finished turn just reports its state (approvals it
        waits for are decided by the stop first)."""
        conversation_id, meta = await self._locate(turn_id, tenant)
        if meta["status"] == TurnStatus.AWAITING_APPROVAL:
            await self.approvals.stop_waiting(conversation_id, turn_id)
        keys, settings = self._keys, self._settings
        outcome = await self._scripts.cancel_turn(
            turn=keys.turn(conversation_id, turn_id),
            events_key=keys.events(conversation_id, turn_id),
            tombstone=keys.tombstone(conversation_id, turn_id),
            conversation_turns=keys.conversation_turns(conversation_id),
            lease=keys.lease(conversation_id, turn_id),
            ttl_ms=settings.stream_ttl_ms,
            tombstone_ms=settings.tombstone_ttl_ms,
        )
        if outcome.result == "missing":
            raise Gone(f"turn {turn_id!r} expired", code="expired")
        self._metrics.cancels.labels(outcome.result).inc()
        if outcome.result == "cancelled":
            self._metrics.turns_finished.labels(TurnStatus.CANCELLED).inc()
            await self._admission.release_if_done(conversation_id, turn_id, outcome.attempt)
        if outcome.result == "signalled":
            await self._notify_stop(conversation_id, turn_id, outcome.attempt)
            await self._settle(conversation_id, turn_id)
        log.info("turn %s: stop requested (%s)", turn_id, outcome.result)
        return await self.get(turn_id, tenant)

    async def _settle(self, conversation_id: str, turn_id: str) -> None:
        """Wait, up to ``CANCEL_WAIT_S``, for a signalled attempt to end, so that the stop
        button answers with the stopped turn; a worker that does not answer in time (a lost
        notification, a dead worker) leaves the turn to its stop flag, and the answer shows it
        still running."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_WAIT_S
        key = self._keys.turn(conversation_id, turn_id)
        while loop.time() < deadline:
            status = await rc.hget(self._redis, key, "status")
            if status is None or status in FINAL_STATUSES:
                return
            await asyncio.sleep(CANCEL_POLL_S)

    async def _notify_stop(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Reach the worker holding the lease at once, wherever it runs.

        The stop flag is durable: a worker that misses this message sees the flag at its next
        append or lease heartbeat.
        """
        await self._jobs.publish_stop(conversation_id, turn_id, attempt)

    async def promote(
        self, turn_id: str, request: CanonicalRequest, tenant: str | None = None
    ) -> dict[str, Any]:
        """Make an attempt canonical by compare-and-set; 409 when the canonical one changed."""
        conversation_id, _ = await self._locate(turn_id, tenant)
        expected = "" if request.expected is None else str(request.expected)
        promoted = await self._scripts.promote_attempt(
            turn=self._keys.turn(conversation_id, turn_id),
            attempt=request.attempt,
            expected=expected,
        )
        if promoted.result == "conflict":
            current = promoted.value or "none"
            raise Conflict(
                f"the canonical attempt is {current}, not {request.expected or 'none'}: "
                "reload the turn and choose again",
                code="canonical_changed",
            )
        if promoted.result == "not_allowed":
            raise NotAllowed(promoted.value, code="not_promotable")
        if promoted.result == "missing":
            raise NotFound(f"turn {turn_id!r} has no attempt {request.attempt}")
        return await self.get(turn_id, tenant)

    async def history(
        self, client_conversation_id: str, tenant: str | None = None
    ) -> dict[str, Any]:
        """What the next request must send: each turn's input, then its canonical answer.

        A turn contributes the messages at the end of its request that are not assistant
        messages (its new input; the leading system messages of the first turn come too), and
        then one assistant message with its canonical attempt's text, flagged ``partial`` when
        that answer was cut short. Turns without a canonical answer contribute their input only.
        """
        if not ID_PATTERN.fullmatch(client_conversation_id):
            raise NotFound(f"unknown conversation {client_conversation_id[:80]!r}")
        conversation_id = scoped(tenant, client_conversation_id)
        keys = self._keys
        turn_ids = await rc.zrange_all(self._redis, keys.conversation_turns(conversation_id))
        async with self._redis.pipeline(transaction=False) as pipe:
            for turn_id in turn_ids:
                pipe.hmget(
                    keys.turn(conversation_id, turn_id),
                    ["request", "status", "canonical", "attempt"],
                )
            rows: list[list[str | None]] = await pipe.execute()
        messages: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        for turn_id, (raw_request, status, canonical, _attempt) in zip(turn_ids, rows, strict=True):
            if raw_request is None:
                continue  # expired
            request_messages: list[dict[str, Any]] = orjson.loads(raw_request)["messages"]
            tail = _new_input(request_messages, first=not messages)
            messages += [_sendable(m) for m in tail]
            entry: dict[str, Any] = {"turn_id": turn_id, "status": status, "canonical": None}
            if canonical:
                text, record = await rc.hmget(
                    self._redis,
                    keys.turn(conversation_id, turn_id),
                    [f"text:{canonical}", f"attempt:{canonical}"],
                )
                decoded = AttemptRecord.decode(record)
                attempt_status = decoded.status if decoded is not None else None
                answer: dict[str, Any] = {"role": "assistant", "content": text or ""}
                partial = attempt_status not in WHOLE_ANSWERS
                if partial:
                    answer["partial"] = True
                if decoded is not None and decoded.tool_calls:
                    answer["tool_calls"] = [_history_call(c) for c in decoded.tool_calls]
                messages.append(answer)
                entry["canonical"] = int(canonical)
                entry["partial"] = partial
            turns.append(entry)
        if not turns:
            raise NotFound(f"unknown conversation {client_conversation_id!r}")
        return {"conversation_id": client_conversation_id, "messages": messages, "turns": turns}


def _new_input(messages: list[dict[str, Any]], *, first: bool) -> list[dict[str, Any]]:
    """The trailing non-assistant messages of a request (all leading system ones for a first)."""
    start = len(messages)
    while start > 0 and messages[start - 1].get("role") != "assistant":
        start -= 1
    tail = messages[start:]
    if first and start > 0:
        tail = [m for m in messages[:start] if m.get("role") == "system"] + tail
    return tail


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    """A pending client call as an assistant message's ``tool_calls`` entry."""
    return {"id": call["call_id"], "name": call["name"], "arguments": call["arguments"]}


def _sendable(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None}
