"""The Durable Streams streams' key space: four keys per stream, in its tenant's slot, beside
the tenant's accounting and its forks' references.

A tenant's streams share one hash tag, ``{ds:t:<tenant>}`` (an open broker's, ``{ds:open}``),
so that every ``ds_*`` script touches one slot. Tenant names hold no brace, and a path only ever
goes into a digest, so these spaces never meet each other nor the conversations' keys.
"""

from __future__ import annotations

import dataclasses
import hashlib


def ds_digest(path: str) -> str:
    """A Durable Streams path's name in keys and in its tenant's accounting: any path makes a
    safe one."""
    return hashlib.blake2b(path.encode(), digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class StreamKeys:
    """One stream's keys and its tenant's accounting keys, all in the tenant's slot."""

    tenant: str | None
    path: str  # within its tenant
    member: str  # its name in the tenant's accounting (a digest of its path)
    meta: str
    data: str
    producers: str
    forks: str
    streams: str
    sizes: str
    usage: str
    subs: tuple[str, str, str, str]  # the tenant's subscriptions' keys an append marks

    @property
    def all(self) -> tuple[str, str, str]:
        return (self.meta, self.data, self.producers)

    @property
    def with_forks(self) -> tuple[str, str, str, str]:
        return (self.meta, self.data, self.producers, self.forks)

    @property
    def accounts(self) -> tuple[str, str, str]:
        return (self.streams, self.sizes, self.usage)


@dataclasses.dataclass(frozen=True, slots=True)
class KeySpace:
    """The Durable Streams keys under one key prefix (``BROKER_KEY_PREFIX``)."""

    prefix: str

    def space(self, tenant: str | None) -> str:
        """The hash tag of a tenant's streams: ``{ds:t:<tenant>}``, or ``{ds:open}`` for an
        open broker's, whose callers have no tenant."""
        mark = "open" if tenant is None else f"t:{tenant}"
        return f"{self.prefix}:{{ds:{mark}}}"

    def stream(self, tenant: str | None, path: str) -> str:
        """The common part of a stream's keys: its tenant's space and a digest of its path."""
        return f"{self.space(tenant)}:s:{ds_digest(path)}"

    def meta(self, tenant: str | None, path: str) -> str:
        """Hash: a stream's path, content type, TTL or expiry, closure, tail and the producer
        that closed it (its existence is the stream's)."""
        return f"{self.stream(tenant, path)}:meta"

    def data(self, tenant: str | None, path: str) -> str:
        """Redis Stream: a stream's appends, one entry each (entry ids are its offsets; fields
        ``e m b <bytes>``, or ``e m d <Latin-1 text>`` as older streams wrote them), and a last
        ``close`` entry once it is closed (that wakes its live readers)."""
        return f"{self.stream(tenant, path)}:data"

    def producers(self, tenant: str | None, path: str) -> str:
        """Hash: producer id -> ``<epoch> <last seq>`` of a stream's idempotent producers."""
        return f"{self.stream(tenant, path)}:producers"

    def forks(self, tenant: str | None, path: str) -> str:
        """Set: the paths of a stream's forks (their references on it: while it has one, its
        data and this set have no expiry, see ``broker/lua/_ds_quota.lua``)."""
        return f"{self.stream(tenant, path)}:forks"

    def data_of(self, tenant: str | None, member: str) -> str:
        """The data key of the stream whose digest is ``member`` (a fork's chain names its
        sources by their digests)."""
        return f"{self.space(tenant)}:s:{member}:data"

    def refs(self, tenant: str | None) -> str:
        """Hash: a fork's digest -> ``<its source's digest> <its path>``, its reference on its
        source (written and read by the scripts only, which build its name from ``streams``)."""
        return f"{self.space(tenant)}:refs"

    def streams(self, tenant: str | None) -> str:
        """Sorted set: the tenant's streams that count against its quota (each its path's
        digest), scored by when they expire (ms; ``inf`` for never)."""
        return f"{self.space(tenant)}:streams"

    def sizes(self, tenant: str | None) -> str:
        """Hash: path digest -> the bytes each of the tenant's counted streams holds."""
        return f"{self.space(tenant)}:sizes"

    def usage(self, tenant: str | None) -> str:
        """Hash: the tenant's bytes in all (``bytes``) and its append rate's token bucket
        (``tokens``, ``ts`` = last refill in ms)."""
        return f"{self.space(tenant)}:usage"

    def subs(self, tenant: str | None) -> tuple[str, str, str, str]:
        """The tenant's subscription keys a write marks (``broker.durable_store.subscriptions``):
        its registry (hash), their links (hash), the due set (sorted set) and the marks (hash)."""
        space = self.space(tenant)
        return (f"{space}:subs", f"{space}:subs:links", f"{space}:subs:due", f"{space}:subs:marks")

    def of(self, tenant: str | None, path: str) -> StreamKeys:
        """The keys of the stream at ``path`` of ``tenant`` (None: an open broker's)."""
        return StreamKeys(
            tenant,
            path,
            ds_digest(path),
            self.meta(tenant, path),
            self.data(tenant, path),
            self.producers(tenant, path),
            self.forks(tenant, path),
            self.streams(tenant),
            self.sizes(tenant),
            self.usage(tenant),
            self.subs(tenant),
        )
