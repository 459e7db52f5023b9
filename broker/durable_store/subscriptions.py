"""Durable Streams subscriptions: which streams wake whom, and the leases of their wakes.

A subscription lives in its tenant's slot beside the tenant's streams (``{ds:t:<tenant>}``,
``{ds:open}``): a hash of its own (configuration, wake state), the offsets it acked, and three
tenant-wide keys that the append's mark walks (the registry of the tenant's subscriptions, the
links ``<id>\\n<path>`` of their streams, the due set of subscriptions to look at, and a count
of marks per subscription). Every write is one ``ds_sub_*`` script over one slot.

An append (or a creation) marks the tenant's subscriptions whose pattern matches the path (or
that list it) as due, in the same request, before it is answered: a tenant with none pays one
``EXISTS``. The wake loop (:mod:`broker.durable_store.wakes`) looks at due subscriptions. A
wake is a lease with a fencing token, taken by ``ds_sub_claim`` (by the webhook send, or by a
pull-wake worker's claim); its holder acks offsets under it and ends it (done, or release);
a lease that ends unrenewed is taken again with the next generation, and whatever its
holder sends then is fenced (409 ``FENCED``).

Clocks: leases run on Redis's clock (``TIME``) unless a clock is given (tests run a fake one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

import orjson
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.durable_store.keys import KeySpace
from broker.durable_store.protocol import offset_of
from broker.durable_store.records import AppendRequest
from broker.durable_store.service import DurableStore
from broker.durable_store.sub_model import Signer, SubscriptionConfig
from broker.errors import BadRequest, BrokerError, Conflict, NotFound
from broker.scripts import Scripts

ORIGIN_OFFSET: Final = "0000000000000000_0000000000000000"
NO_ACK: Final = "-1"  # what GET shows for a stream nothing was acked of
# The most subscriptions a tenant holds: every append of the tenant walks them all in its script
# (one pattern match each), so that walk stays short for Redis.
MAX_SUBSCRIPTIONS: Final = 256
SIGNER_CHECK_S: Final = 30.0
Mode = Literal["deliver", "claim", "announce"]


class Fenced(BrokerError):
    """A callback, ack or release of a wake that is no longer the live one."""

    code = "FENCED"
    status = 409


class TooManySubscriptions(BrokerError):
    """A tenant's subscriptions are at their most (every append walks them: see the module)."""

    code = "subscription_quota"
    status = 429


class AlreadyClaimed(BrokerError):
    """A pull-wake claim while another worker holds the wake."""

    code = "ALREADY_CLAIMED"
    status = 409

    def __init__(self, holder: str) -> None:
        super().__init__(f"the wake is claimed by {holder!r}")
        self.holder = holder


def _digest(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class SubKeys:
    """One subscription's keys and its tenant's subscription keys, all in the tenant's slot."""

    space: str

    @property
    def registry(self) -> str:
        return f"{self.space}:subs"

    @property
    def links(self) -> str:
        return f"{self.space}:subs:links"

    @property
    def due(self) -> str:
        return f"{self.space}:subs:due"

    @property
    def marks(self) -> str:
        return f"{self.space}:subs:marks"

    def sub(self, sub_id: str) -> str:
        return f"{self.space}:sub:{_digest(sub_id)}"

    def acked(self, sub_id: str) -> str:
        return f"{self.sub(sub_id)}:acked"


@dataclasses.dataclass(frozen=True, slots=True)
class StreamState:
    """One stream of a subscription: how it is linked, its tail and what was acked of it."""

    path: str
    link_type: str  # "pattern" or "explicit"
    tail_offset: str
    acked_offset: str  # NO_ACK for none
    has_pending: bool

    def json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Subscription:
    id: str
    config: SubscriptionConfig
    base: str  # the URL its callbacks and JWKS are under
    streams: list[StreamState]
    generation: int
    holder: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Wake:
    """A wake that started: the lease's token and the streams it is about."""

    sub_id: str
    wake_id: str
    generation: int
    token: str
    streams: list[StreamState]
    config: SubscriptionConfig
    base: str


class Subscriptions:
    """Create, look at and delete subscriptions; mark them from appends; claim, ack, release."""

    def __init__(
        self, deps: Deps, store: DurableStore, clock: Callable[[], int] | None = None
    ) -> None:
        self._redis: Redis = deps.redis
        self._scripts: Scripts = deps.scripts
        self._prefix = deps.keys.prefix
        self._space = KeySpace(deps.keys.prefix)
        # The tenants known to have subscriptions (made here, or seen by the wake loop's look):
        # an append of one of them makes this process's wake loop look at once.
        self.known: set[str | None] = set()
        self._store = store
        self._clock = clock
        self._signer: Signer | None = None
        self._signer_read = 0.0  # (monotonic) when the key was last read

    def keys(self, tenant: str | None) -> SubKeys:
        return SubKeys(self._space.space(tenant))

    @property
    def tenants_key(self) -> str:
        """Set: the tenants that ever had a subscription ("-": an open broker's, "t:<name>")."""
        return f"{self._prefix}:{{ds:subs}}:tenants"

    def _now(self) -> str:
        return "" if self._clock is None else str(self._clock())

    def now_ms(self, fallback: int) -> int:
        return fallback if self._clock is None else self._clock()

    async def signer(self) -> Signer:
        """The broker's wake-signing key: made once by the first process that needs it and kept
        in Redis (``<prefix>:{ds:subs}:signing``), so every process signs with the same key
        and it survives restarts; whoever can read the broker's Redis can sign wakes. Read
        again every ``SIGNER_CHECK_S``: a key that was replaced (a flushed Redis) is followed."""
        now = time.monotonic()
        if self._signer is None or now - self._signer_read > SIGNER_CHECK_S:
            key = f"{self._prefix}:{{ds:subs}}:signing"
            seed = await rc.get(self._redis, key)
            if seed is None:
                await self._redis.set(key, secrets.token_bytes(32).hex(), nx=True)
                seed = await rc.get(self._redis, key)
            assert seed is not None
            if self._signer is None or not self._signer.made_from(seed):
                self._signer = Signer(bytes.fromhex(seed))
            self._signer_read = now
        return self._signer

    # --- the subscriptions ----------------------------------------------------------------------

    async def put(
        self, tenant: str | None, sub_id: str, config: SubscriptionConfig, base: str
    ) -> bool:
        """Create the subscription (True) or find the same one (False); 409 for another."""
        keys = self.keys(tenant)
        await self._redis.sadd(self.tenants_key, "-" if tenant is None else f"t:{tenant}")
        self.known.add(tenant)
        reply = await self._scripts(
            "ds_sub_put",
            [keys.sub(sub_id), keys.registry, keys.links],
            [sub_id, config.canonical, config.matcher, base, MAX_SUBSCRIPTIONS, *config.streams],
        )
        result = str(reply[0])
        if result == "full":
            raise TooManySubscriptions(
                f"a tenant holds at most {MAX_SUBSCRIPTIONS} subscriptions: delete one first"
            )
        if result == "conflict":
            raise Conflict(
                f"subscription {sub_id!r} exists with another configuration",
                code="subscription_conflict",
            )
        return result == "created"

    async def _config(self, keys: SubKeys, sub_id: str) -> tuple[SubscriptionConfig, str]:
        cfg, base = await rc.hmget(self._redis, keys.sub(sub_id), ["cfg", "base"])
        if cfg is None:
            raise NotFound(f"no subscription {sub_id!r}", code="subscription_not_found")
        return SubscriptionConfig.of_json(cfg), str(base or "")

    async def get(self, tenant: str | None, sub_id: str) -> Subscription:
        keys = self.keys(tenant)
        config, base = await self._config(keys, sub_id)
        gen, holder = await rc.hmget(self._redis, keys.sub(sub_id), ["gen", "holder"])
        return Subscription(
            sub_id,
            config,
            base,
            await self.states(tenant, sub_id),
            int(gen or 0),
            holder or None,
        )

    async def delete(self, tenant: str | None, sub_id: str) -> None:
        keys = self.keys(tenant)
        found = await self._scripts(
            "ds_sub_delete",
            [
                keys.sub(sub_id),
                keys.acked(sub_id),
                keys.registry,
                keys.links,
                keys.due,
                keys.marks,
            ],
            [sub_id],
        )
        if not found:
            raise NotFound(f"no subscription {sub_id!r}", code="subscription_not_found")

    async def link(
        self, tenant: str | None, sub_id: str, op: Literal["add", "remove"], paths: Sequence[str]
    ) -> None:
        keys = self.keys(tenant)
        found = await self._scripts(
            "ds_sub_link",
            [keys.sub(sub_id), keys.links, keys.due, keys.acked(sub_id)],
            [sub_id, op, self._now() or "0", *paths],
        )
        if not found:
            raise NotFound(f"no subscription {sub_id!r}", code="subscription_not_found")

    async def states(self, tenant: str | None, sub_id: str) -> list[StreamState]:
        """The subscription's streams, with their tails and acks (read now)."""
        keys = self.keys(tenant)
        prefix = f"{sub_id}\n"
        links = await rc.hgetall(self._redis, keys.links)
        acked = await rc.hgetall(self._redis, keys.acked(sub_id))
        found = []
        for field, link_type in sorted(links.items()):
            if not field.startswith(prefix):
                continue
            path = field[len(prefix) :]
            tail = await self._tail(tenant, path)
            ack = acked.get(path)
            pending = tail > (ack or ORIGIN_OFFSET)
            found.append(StreamState(path, link_type, tail, ack or NO_ACK, pending))
        return found

    async def _tail(self, tenant: str | None, path: str) -> str:
        try:
            meta = await self._store.meta(tenant, path)
        except BrokerError:
            return ORIGIN_OFFSET  # not made yet, or gone: nothing to wake for
        return offset_of(meta.tail)

    # --- marks, wakes and their leases ----------------------------------------------------------

    async def mark(self, tenant: str | None, path: str) -> int:
        """Mark the subscriptions a write to ``path`` concerns as due (``ds_append`` and
        ``ds_create`` make this mark themselves, in the same call as the write)."""
        keys = self.keys(tenant)
        now = self._now() or str(int(time.time() * 1000))  # a score: order, not a lease
        marked = await self._scripts(
            "ds_sub_mark", [keys.registry, keys.links, keys.due, keys.marks], [path, now]
        )
        return int(marked)

    async def start(
        self, tenant: str | None, sub_id: str, mode: Mode, holder: str
    ) -> Wake | tuple[str, str] | None:
        """Start a wake (``Wake``), or find it held (``("busy", holder)``) or announced
        (``("announced", "")``), or nothing pending (None)."""
        keys = self.keys(tenant)
        config, base = await self._config(keys, sub_id)
        marks = await rc.hget(self._redis, keys.marks, sub_id) or "0"
        streams = await self.states(tenant, sub_id)
        pending = [s for s in streams if s.has_pending]
        token, wake_id = secrets.token_urlsafe(24), "w_" + secrets.token_hex(8)
        reply = await self._scripts(
            "ds_sub_claim",
            [keys.sub(sub_id), keys.due, keys.marks],
            [
                sub_id,
                self._now(),
                mode,
                holder,
                token,
                wake_id,
                config.lease_ttl_ms,
                marks,
                "1" if pending else "",
                orjson.dumps([[s.path, s.tail_offset] for s in pending]).decode(),
            ],
        )
        result = str(reply[0])
        if result == "claimed":
            return Wake(sub_id, wake_id, int(reply[1]), token, streams, config, base)
        if result == "busy":
            return ("busy", str(reply[1]))
        if result == "announced":
            return ("announced", "")
        if result == "missing":
            raise NotFound(f"no subscription {sub_id!r}", code="subscription_not_found")
        return None

    async def claim(self, tenant: str | None, sub_id: str, worker: str) -> Wake | None:
        """A pull-wake worker's claim: the wake (None: nothing pending); 409 when held, 400 for
        a webhook subscription (its wakes go to its URL)."""
        config, _ = await self._config(self.keys(tenant), sub_id)
        if config.kind != "pull-wake":
            raise BadRequest("only a pull-wake subscription is claimed", code="not_pull_wake")
        found = await self.start(tenant, sub_id, "claim", worker)
        if isinstance(found, tuple):
            raise AlreadyClaimed(found[1])
        return found

    async def ack(
        self,
        tenant: str | None,
        sub_id: str,
        *,
        token: str,
        wake_id: str,
        generation: int,
        acks: Sequence[tuple[str, str]],
        done: bool,
        retry: tuple[int, int, float] | None = None,
    ) -> tuple[bool, int]:
        """Ack offsets under a wake's lease (renewing it), or end it (``done``): whether a wake
        follows, and (``retry``: a failed send's first and longest pause and a jitter fraction)
        the pause before the next send. 409 ``FENCED`` for a wake that is not the live one, 400
        for an ack of a stream that is not the subscription's."""
        keys = self.keys(tenant)
        config, _ = await self._config(keys, sub_id)
        reply = await self._scripts(
            "ds_sub_ack",
            [keys.sub(sub_id), keys.acked(sub_id), keys.due, keys.links],
            [
                sub_id,
                self._now(),
                token,
                wake_id,
                generation,
                "1" if done else "",
                config.lease_ttl_ms,
                "" if retry is None else f"{retry[0]} {retry[1]} {retry[2]:.6f}",
                orjson.dumps([list(a) for a in acks]).decode(),
            ],
        )
        result = str(reply[0])
        if result == "missing":
            raise NotFound(f"no subscription {sub_id!r}", code="subscription_not_found")
        if result == "fenced":
            raise Fenced("this wake is not the live one (a later generation took it, or it ended)")
        if result == "unknown_stream":
            raise BadRequest(
                f"acks names {reply[1]!r}, not a stream of subscription {sub_id!r}",
                code="unknown_stream",
            )
        return bool(int(reply[1])), int(reply[2])

    async def announced(self, tenant: str | None, sub_id: str) -> bool:
        """Whether a pull-wake subscription's wake stream was told of its pending wake."""
        return await rc.hget(self._redis, self.keys(tenant).sub(sub_id), "announced") == "1"

    async def forget(self, tenant: str | None, sub_id: str) -> None:
        """Take a subscription that is no more off the due set."""
        await self._redis.zrem(self.keys(tenant).due, sub_id)

    async def due(self, now_ms: int, limit: int = 32) -> list[tuple[str | None, str]]:
        """Subscriptions due by ``now_ms``, of every tenant that has some."""
        found: list[tuple[str | None, str]] = []
        for mark in await rc.smembers(self._redis, self.tenants_key):
            tenant = None if mark == "-" else str(mark)[2:]
            self.known.add(tenant)
            ids = await self._redis.zrangebyscore(
                self.keys(tenant).due, "-inf", now_ms, start=0, num=limit
            )
            found.extend((tenant, str(i)) for i in ids)
        return found

    async def wake_event(self, tenant: str | None, wake_stream: str, body: bytes) -> None:
        """Tell a pull-wake subscription's wake stream (a JSON stream of the tenant)."""
        await self._store.append(
            tenant,
            wake_stream,
            AppendRequest(content_type="application/json", body=body),
        )
