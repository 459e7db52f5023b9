"""A viewer: one SSE connection reading a generation, through any door, and the rules of the
attach token it reads with.

Every door's read of a generation goes through here, so that no door can forget a rule:
:func:`admit` checks the token against the read (its one stream; a one-viewer token reads over
SSE only: a JSON page, a catch-up or a long poll takes no lock, so it could read beside the one
viewer), and :func:`as_viewer` wraps the door's SSE frame source: the viewers gauge, and the
one-viewer lock below. Each door ends a replaced connection with a last frame of its own.
(:mod:`broker.relay` calls it for every door's streamed read.)

A one-viewer token admits one SSE connection at a time: the connection takes a lock in Redis
named after the token (``SET PX``) and renews it while it lasts. The newest connection wins: a
phone whose network changed reconnects from a new address while the broker may still hold its
old connection (a path that died without a FIN looks alive for minutes), so a new connection
takes the lock over, and the connection that held it ends at its next frame once its renewal
finds the lock gone (within a third of ``VIEWER_LEASE_MS``), with a last ``replaced`` event
(no id: it is no event of the stream) that tells its client not to reconnect; the project's
clients stop there. Two viewers of one token never read at once for longer than that.

The teardown (the viewers gauge, the lock's release, leaving the feed) runs on every way out of
the response's source, and never depends on a cancellation reaching it: redis-py may swallow
one that lands while it awaits a reply.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import NoReturn

from prometheus_client import Gauge
from redis.exceptions import RedisError

from broker.auth import Principal
from broker.deps import Deps
from broker.errors import Forbidden
from broker.metrics import Metrics
from broker.periodic import Periodic
from broker.reader import Location
from broker.scripts import Scripts
from broker.sse import Sink

log = logging.getLogger("broker.viewer")

# A door's SSE frames of one read, given the response they go to.
FrameSource = Callable[[Sink], AsyncIterator[bytes]]

# One-viewer attach tokens hold a lock for their connection, renewed while it lasts.
VIEWER_LEASE_MS = 10_000
# The last frame of a native (and Durable Streams) one-viewer connection whose lock a newer
# connection took.
REPLACED = (
    b"event: replaced\n"
    b'data: {"code":"viewer_replaced","message":"a newer connection of this one-viewer token '
    b'took over; do not reconnect"}\n\n'
)


class ViewerLock:
    """The lock a one-viewer attach token's connection holds while it lasts."""

    def __init__(self, scripts: Scripts, key: str, holder: str) -> None:
        self.scripts, self.key, self.holder = scripts, key, holder
        self.lost = False
        self._keeper: Periodic | None = None

    def keep(self) -> None:
        """Renew the lock until :meth:`release`; a lost lock ends the stream at its next frame."""
        self._keeper = Periodic(self._renew, VIEWER_LEASE_MS / 3000, name="viewer lock")

    async def _renew(self) -> bool:
        try:
            held = await self.scripts.renew_viewer(
                viewer=self.key, holder=self.holder, ttl_ms=VIEWER_LEASE_MS
            )
        except (RedisError, OSError):
            return True  # the lock lives VIEWER_LEASE_MS: the next renewal may still make it
        self.lost = not held
        return not self.lost

    async def release(self) -> None:
        if self._keeper is not None:
            await self._keeper.stop()
        with contextlib.suppress(RedisError, OSError):
            await self.scripts.release_viewer(viewer=self.key, holder=self.holder)


class _ViewerSink:
    """A response as seen by a one-viewer read: over, and refusing writes, once the lock is lost."""

    def __init__(self, sink: Sink, viewer: ViewerLock) -> None:
        self._sink, self._viewer = sink, viewer

    @property
    def over(self) -> bool:
        return self._viewer.lost or self._sink.over

    def write_now(self, chunk: bytes) -> bool:
        # A lost lock stops direct writes: the next chunk comes to the reader, which ends.
        return not self._viewer.lost and self._sink.write_now(chunk)


def check_stream(metrics: Metrics, principal: Principal, stream_id: str) -> None:
    """403 ``wrong_stream`` when ``principal`` is an attach token of another stream."""
    if principal.stream_id is not None and principal.stream_id != stream_id:
        refuse_other_stream(metrics)


def refuse_other_stream(metrics: Metrics) -> NoReturn:
    """403 ``wrong_stream``: an attach token asked for what is not its stream's."""
    metrics.auth_failures.labels("forbidden").inc()
    raise Forbidden("the attach token is for another stream", code="wrong_stream")


def admit(metrics: Metrics, principal: Principal, stream_id: str, *, sse: bool) -> None:
    """The token rules of a read of generation ``stream_id``, whatever its door: 403
    ``wrong_stream`` for an attach token of another stream, 403 ``sse_only`` for a one-viewer
    token's read that is not SSE (a JSON page, a catch-up, a long poll)."""
    check_stream(metrics, principal, stream_id)
    if principal.one_viewer and not sse:
        raise Forbidden("a one-viewer attach token reads over SSE only", code="sse_only")


async def as_viewer(
    deps: Deps,
    principal: Principal,
    location: Location,
    source: FrameSource,
    *,
    replaced: bytes,
    dialect: str,
) -> FrameSource:
    """``source``, a door's SSE frames of ``location``, as ``principal``'s viewer: admitted,
    counted in the viewers gauge (under the door's ``dialect``) while it lasts, and for a
    one-viewer token holding the token's
    lock, taken over from any older connection of any door. Once a newer connection takes the
    lock, the read ends at its next frame with ``replaced``, the door's own last frame."""
    admit(deps.metrics, principal, location.stream_id, sse=True)
    viewer = await hold_viewer(deps, principal, location) if principal.one_viewer else None
    viewers = deps.metrics.viewers.labels("sse", dialect)
    return functools.partial(_viewed, viewers, source, viewer, replaced)


async def _viewed(
    viewers: Gauge,
    source: FrameSource,
    viewer: ViewerLock | None,
    replaced: bytes,
    sink: Sink,
) -> AsyncIterator[bytes]:
    viewers.inc()
    if viewer is not None:
        viewer.keep()
        sink = _ViewerSink(sink, viewer)
    frames = source(sink)
    try:
        async for chunk in frames:
            if viewer is not None and viewer.lost:
                break
            yield chunk
        if viewer is not None and viewer.lost:
            yield replaced
    finally:
        # Closed on every way out, so that the source leaves its feed at once, not when it is
        # collected.
        try:
            if isinstance(frames, AsyncGenerator):
                await frames.aclose()
        finally:
            viewers.dec()
            if viewer is not None:
                await viewer.release()


async def hold_viewer(deps: Deps, principal: Principal, location: Location) -> ViewerLock:
    """Take the one-viewer lock of ``principal``'s attach token, from whoever held it."""
    assert principal.token_id is not None
    key = deps.keys.viewer(location.conversation_id, principal.token_id)
    holder = secrets.token_hex(8)
    previous = await deps.redis.set(key, holder, px=VIEWER_LEASE_MS, get=True)
    if previous is not None:
        log.info("a one-viewer token's new connection took its lock over from an older one")
    return ViewerLock(deps.scripts, key, holder)
