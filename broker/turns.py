"""Turns: the idempotent start of a generation, and its state."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.canonical import canonical_json, fingerprint
from broker.errors import BadRequest, Conflict, Gone, NotFound
from broker.keys import ID_PATTERN, Keys
from broker.metrics import Metrics
from broker.providers import Providers
from broker.providers.simulated import SimulatedProvider
from broker.scripts import Scripts
from broker.settings import Settings
from broker.worker import enqueue

log = logging.getLogger("broker.turns")

ID_REGEX = ID_PATTERN.pattern
RESCUE_INTERVAL_MS = 1_000


class Message(BaseModel):
    """One message of the conversation as the model should see it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = Field(default=None, max_length=128)


class TurnRequest(BaseModel):
    """The body of ``POST /v1/turns``."""

    model_config = ConfigDict(extra="forbid")

    conversation_id: str = Field(pattern=ID_REGEX)
    turn_id: str | None = Field(default=None, pattern=ID_REGEX)
    messages: list[Message] = Field(min_length=1)
    provider: str | None = Field(default=None, max_length=64)
    model: str | None = Field(default=None, max_length=256)
    params: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    response_format: Literal["text", "json"] = "text"


def links(turn_id: str, stream_id: str) -> dict[str, str]:
    return {"self": f"/v1/turns/{turn_id}", "stream": f"/v1/streams/{stream_id}"}


class Turns:
    """Creating and reading turns."""

    def __init__(
        self,
        redis: Redis,
        scripts: Scripts,
        keys: Keys,
        settings: Settings,
        providers: Providers,
        metrics: Metrics,
    ) -> None:
        self._redis = redis
        self._scripts = scripts
        self._keys = keys
        self._settings = settings
        self._providers = providers
        self._metrics = metrics

    def _check_limits(self, request: TurnRequest) -> None:
        limit = self._settings.max_messages
        if len(request.messages) > limit:
            raise BadRequest(
                f"{len(request.messages)} messages is more than BROKER_MAX_MESSAGES={limit}",
                code="too_many_messages",
            )
        longest = max(len(m.content) for m in request.messages)
        if longest > self._settings.max_message_chars:
            raise BadRequest(
                f"a message has {longest} characters, more than "
                f"BROKER_MAX_MESSAGE_CHARS={self._settings.max_message_chars}",
                code="message_too_long",
            )
        provider = self._providers.get(request.provider)
        provider.validate_params(request.params)
        if request.response_format == "json" and isinstance(provider, SimulatedProvider):
            knobs = request.params.get("simulate", {})
            if knobs.get("json") is False:
                raise BadRequest("response_format json contradicts params.simulate.json=false")

    async def create(self, request: TurnRequest) -> tuple[bool, dict[str, Any]]:
        """Start a turn, or find the one with the same ``turn_id``; True when it is new."""
        self._check_limits(request)
        turn_id = request.turn_id or f"t_{secrets.token_hex(16)}"
        conversation_id = request.conversation_id
        body = request.model_dump(exclude={"turn_id"})
        body["provider"] = self._providers.get(request.provider).name
        fp = fingerprint(body)
        keys = self._keys
        index_ttl_ms = int((self._settings.stream_ttl + self._settings.tombstone_ttl) * 1000)
        claimed = await self._redis.set(
            keys.turn_index(turn_id), conversation_id, nx=True, px=index_ttl_ms
        )
        if not claimed:
            owner = await self._redis.get(keys.turn_index(turn_id))
            if owner is not None and owner != conversation_id:
                raise Conflict(
                    f"turn {turn_id!r} exists with a different request", code="turn_conflict"
                )
        stream_id = f"st_{secrets.token_hex(16)}"
        record = {"n": 1, "strategy": "initial", "status": "queued", "reason": None}
        reply = await self._scripts(
            "create_turn",
            [keys.turn(conversation_id, turn_id), keys.tombstone(conversation_id, turn_id)],
            [fp, stream_id, conversation_id, turn_id, canonical_json(body).decode(),
             conversation_id, orjson.dumps(record).decode()],
        )  # fmt: skip
        result = reply[0]
        if result == "expired":
            raise Gone(
                f"turn {turn_id!r} finished and expired; start a new turn with a new turn_id",
                code="expired",
            )
        if result == "conflict":
            raise Conflict(
                f"turn {turn_id!r} exists with a different request", code="turn_conflict"
            )
        stream_id, status, attempt = reply[1], reply[2], int(reply[3])
        if result == "created":
            await self._redis.set(
                keys.stream_index(stream_id), f"{conversation_id} {turn_id}", px=index_ttl_ms
            )
            await self._enqueue(conversation_id, turn_id, attempt)
            self._metrics.turns_started.inc()
            log.info("turn %s started in conversation %s, stream %s", turn_id, conversation_id,
                     stream_id)  # fmt: skip
        else:
            # The first request may still be between its two steps: make sure a reader finds
            # the stream before we hand out its id, and rescue a turn a crash left unqueued.
            await self._redis.set(
                keys.stream_index(stream_id), f"{conversation_id} {turn_id}",
                nx=True, px=index_ttl_ms,
            )  # fmt: skip
            if status == "queued" and reply[5] != "1":
                await self._rescue(conversation_id, turn_id, attempt)
            self._metrics.turns_deduplicated.inc()
        return result == "created", {
            "turn_id": turn_id,
            "conversation_id": conversation_id,
            "stream_id": stream_id,
            "status": status,
            "attempt": attempt,
            "links": links(turn_id, stream_id),
        }

    async def _enqueue(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        await enqueue(self._redis, self._keys, conversation_id, turn_id, attempt)
        await self._redis.hset(self._keys.turn(conversation_id, turn_id), "enqueued", "1")

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

    async def get(self, turn_id: str) -> dict[str, Any]:
        """The turn's state: status, attempts and the canonical attempt's text."""
        if not ID_PATTERN.match(turn_id):
            raise NotFound(f"unknown turn {turn_id[:80]!r}")
        conversation_id = await rc.get(self._redis, self._keys.turn_index(turn_id))
        if conversation_id is None:
            raise NotFound(f"unknown turn {turn_id!r}")
        meta = await rc.hgetall(self._redis, self._keys.turn(conversation_id, turn_id))
        if not meta:
            if await self._redis.exists(self._keys.tombstone(conversation_id, turn_id)):
                raise Gone(f"turn {turn_id!r} expired", code="expired")
            raise NotFound(f"unknown turn {turn_id!r}")  # being created right now, or never was
        if meta["status"] == "queued" and meta.get("enqueued") != "1":
            await self._rescue(conversation_id, turn_id, int(meta["attempt"]))
        attempts = []
        for n in range(1, int(meta["attempt"]) + 1):
            raw = meta.get(f"attempt:{n}")
            if raw:
                attempts.append(orjson.loads(raw))
        canonical = None
        if meta.get("canonical"):
            n = int(meta["canonical"])
            canonical = {"attempt": n, "text": meta.get(f"text:{n}", "")}
        stream_id = meta["stream_id"]
        return {
            "turn_id": turn_id,
            "conversation_id": conversation_id,
            "stream_id": stream_id,
            "status": meta["status"],
            "attempt": int(meta["attempt"]),
            "attempts": attempts,
            "canonical": canonical,
            "created_ms": int(meta["created_ms"]),
            "links": links(turn_id, stream_id),
        }
