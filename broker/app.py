"""The broker's runtime (Redis, scripts, hub, worker) and the ASGI app around it.

The app's lifespan owns the runtime. Shutdown runs in the order that loses nothing: stop taking
jobs, let running generations finish (or interrupt them with a terminal event after
``BROKER_DRAIN_TIMEOUT_S``), end the open streams so their clients resume elsewhere, and only then
close Redis and stop the embedded server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, cast

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from redis.asyncio import Redis
from starlette.types import ASGIApp

from broker import __version__
from broker import redis_calls as rc
from broker.admission import Admission
from broker.api.docs import install_docs
from broker.api.errors import install_error_handlers
from broker.api.limits import BodySizeLimit, HeaderSizeLimit
from broker.api.openapi import install_components
from broker.api.routes import api_router, ops_router
from broker.api.security import COMMON, SecurityHeaders, cors_origins
from broker.api.stream_reads import FrontDoor, StreamReads
from broker.auth import Authenticator
from broker.compression import Compression
from broker.connection import (
    POOL_KEEP_IDLE,
    POOL_MIN_IDLE,
    check_eviction_policy,
    client,
    connect,
    is_cluster_url,
    redact,
    trim_idle_connections,
)
from broker.deps import Deps, scripts_for
from broker.dialects.aisdk import router as aisdk_router
from broker.dialects.durable import router as durable_router
from broker.dialects.durable.door import DurableDoor
from broker.dialects.durable.wire import DS_REQUEST_HEADERS, DS_RESPONSE_HEADERS
from broker.dialects.openai import router as openai_router
from broker.durable_store import DurableStore, Subscriptions, WakeLoop
from broker.embedded_redis import EmbeddedRedis
from broker.fanout import FEED_BLOCK_MS, Hub
from broker.fastpath import ConnectionLimits, http_protocol_class, probe, uncapped_addresses
from broker.http import Services
from broker.jobs import JobQueue
from broker.keys import Keys
from broker.ledger import Dispatcher, Ledger
from broker.memory import CrowdWatch, give_back
from broker.metrics import Metrics
from broker.notifier import Notifier
from broker.periodic import Periodic
from broker.providers import Providers
from broker.reader import Streams
from broker.sequence_index import SequenceIndex
from broker.settings import Settings
from broker.sse import RawSend
from broker.tools import ToolRegistry
from broker.turns import Turns
from broker.webhook_config import WebhookConfig
from broker.webhooks import Webhooks, webhook_queue
from broker.worker import Worker

log = logging.getLogger("broker")

# The demo page and the browser client (broker/static/js), shipped as package data.
STATIC_DIR = Path(__file__).resolve().parent / "static"
# On shutdown, how long webhook sends in flight may finish (a cut one is sent again later).
WEBHOOK_DRAIN_S = 2.0
# How often a worker process denies the approvals whose time ran out (BROKER_APPROVAL_TTL_S).
APPROVAL_SWEEP_S = 5.0
CROWD_WATCH_S = 1.0  # how often the process looks whether a crowd of readers left


class Runtime:
    """Everything one broker process holds; built by :meth:`start`, torn down by :meth:`close`.

    The assembly keeps it; the doors' handlers get :attr:`services` (:class:`broker.http.Services`),
    which holds no Redis client and no key builder."""

    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        blocking_redis: Redis,
        metrics: Metrics,
        embedded: EmbeddedRedis | None,
        tools: ToolRegistry,
        auth: Authenticator | None = None,
        providers: Providers | None = None,
        replica_reads: Redis | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.blocking_redis = blocking_redis
        # With BROKER_REPLICA_ACKS on a cluster: the readers' client, which reads the replicas.
        self.replica_reads = replica_reads
        self.metrics = metrics
        self.embedded = embedded
        self.keys = Keys(settings.key_prefix)
        self.scripts = scripts_for(redis, settings, metrics)
        self.deps = Deps(redis, self.scripts, self.keys, settings, metrics)
        self.jobs = JobQueue(redis, self.keys, settings.job_partitions)
        self.providers = providers if providers is not None else Providers(settings)
        linger_s = settings.append_linger_ms / 1000
        if replica_reads is None:
            self.hub = Hub(blocking_redis, metrics, redis, linger_s=linger_s)
        else:
            self.hub = Hub(replica_reads, metrics, linger_s=linger_s)
        self.streams = Streams(self.deps, self.hub, replica_reads)
        # Durable Streams of the protocol's own read the primary: a client reads its writes.
        self.durable = DurableStore(self.deps, self.hub)
        self.auth = auth or Authenticator(settings, secrets.token_bytes(32))
        if auth is None:
            log.warning("attach tokens are signed with a key of this process only")
        self.admission = Admission(self.deps)
        # Completion webhooks: per-turn URLs need an allow-list once credentials are on.
        self.webhook_config = WebhookConfig.from_settings(settings, secured=self.auth.enabled)
        self.webhook_queue = webhook_queue(redis, self.keys, settings.job_partitions)
        self.webhooks = Webhooks(redis, self.keys, self.webhook_queue, self.webhook_config)
        self.notifier: Notifier | None = None
        # Durable Streams subscriptions: an append marks them; the wake loop wakes them.
        self.subscriptions = Subscriptions(self.deps, self.durable)
        self.wakes: WakeLoop | None = None
        self.durable.on_write = self._wrote
        self.turns = Turns(
            self.deps,
            self.providers,
            self.admission,
            self.jobs,
            self.webhooks,
            server_tools=frozenset(tool.name for tool in tools),
            asks_approval=any(tool.approval.mode != "never" for tool in tools),
        )
        self.tools = tools
        self.ledger = Ledger(self.deps)
        self.ledger.on_approval_requested = self.webhooks.watch_approval
        self.http = httpx.AsyncClient(follow_redirects=False)
        self.dispatcher = Dispatcher(tools, self.ledger, self.http, settings, metrics)
        self.sequences = SequenceIndex(self.deps)
        # What the doors' handlers get: the core's objects, no Redis client, no key builder.
        self.services = Services(
            settings=settings,
            metrics=metrics,
            auth=self.auth,
            providers=self.providers,
            turns=self.turns,
            streams=self.streams,
            sequences=self.sequences,
            ledger=self.ledger,
            durable=self.durable,
            subscriptions=self.subscriptions,
            webhook_config=self.webhook_config,
            _deps=self.deps,
        )
        self.worker: Worker | None = None
        self._pool_trim: Periodic | None = None
        self._approval_sweep: Periodic | None = None
        self._crowd = CrowdWatch()
        self._trimmed_at = 0.0  # (time.monotonic) the pools' last regular trim
        self._drained = False
        self._closed = False

    @classmethod
    async def start(cls, settings: Settings, tools: ToolRegistry | None = None) -> Runtime:
        """Connect (or start the embedded server), load the scripts, start the worker.

        ``tools`` is the registry for an embedding program; by default the registry is read
        from ``BROKER_TOOLS`` (none when unset).
        """
        if tools is None:
            tools = ToolRegistry.from_file(settings.tools) if settings.tools else ToolRegistry()
        embedded = None
        url = settings.redis_url
        if url is None:
            embedded = EmbeddedRedis(settings.redis_server)
            url = embedded.start()
            log.info("using embedded %s (%s)", embedded.version, embedded.binary)
        else:
            log.info("using Redis at %s", redact(url))
        fast = probe(settings.fast_path)
        if fast.line() is not None:  # one line: which half is off, and why
            (log.info if settings.fast_path == "off" else log.warning)("%s", fast.line())
        try:
            redis = await connect(url, fast=fast.redis)
            # Blocking reads hold a connection each for up to a few seconds: keep them apart.
            blocking = client(
                url,
                max_connections=10_000,
                socket_timeout=FEED_BLOCK_MS / 1000 + 10,
                fast=fast.redis,
            )
            replica_reads = None
            if settings.replica_acks > 0 and is_cluster_url(url):
                # Readers are told only what a replica has: with writes that wait for the
                # replicas, an event a reader saw survives the failover of its primary.
                replica_reads = client(
                    url,
                    socket_timeout=FEED_BLOCK_MS / 1000 + 10,
                    from_replicas=True,
                    fast=fast.redis,
                )
            providers = Providers(settings)
            metrics = Metrics(providers={p.name: p.models for p in providers})
            auth = Authenticator(settings, b"")
            auth.attach_secret = await shared_attach_secret(redis, settings, auth.enabled)
            rt = cls(
                settings, redis, blocking, metrics, embedded, tools, auth, providers, replica_reads
            )
            if not rt.auth.enabled:
                log.warning(
                    "AUTHENTICATION IS OFF: anyone who can reach this broker can start, read and "
                    "cancel every turn. Fine on your own machine; set BROKER_API_KEYS or "
                    "BROKER_JWT_SECRET / BROKER_JWT_PUBLIC_KEY before exposing it."
                )
            else:
                log.info("authentication: %s", rt.auth.summary)
                if not settings.metrics_token:
                    log.warning(
                        "/metrics is open (model names, traffic): set BROKER_METRICS_TOKEN to "
                        "protect it, or keep the port private"
                    )
            policy = await check_eviction_policy(redis)
            metrics.eviction_policy_safe.set(1 if policy == "noeviction" else 0)
            await rt.scripts.load()
            await rt.jobs.ensure_group()
            if rt.webhook_config.enabled:
                await rt.webhook_queue.ensure_group()
        except BaseException:
            if embedded is not None:
                embedded.stop()
            raise
        watch_s = min(CROWD_WATCH_S, settings.pool_trim_s)
        rt._trimmed_at = time.monotonic()
        rt._pool_trim = Periodic(rt.trim_pools, watch_s, name="redis pool trim")
        if settings.runs_worker:
            rt.worker = Worker(
                rt.deps, blocking, rt.providers, rt.jobs, rt.dispatcher, rt.admission
            )
            rt.worker.start()
            rt._approval_sweep = Periodic(
                rt.sweep_approvals, APPROVAL_SWEEP_S, name="approval expiry"
            )
            rt.wakes = WakeLoop(rt.subscriptions, rt.webhook_config, rt.http, settings)
            rt.wakes.start()
            if rt.webhook_config.enabled:
                rt.notifier = Notifier(rt.deps, rt.webhook_queue, rt.http, rt.webhook_config)
                rt.notifier.start()
                rt.worker.on_attempt_ended = rt.notifier.nudge
        return rt

    async def sweep_approvals(self) -> bool:
        """Deny the approvals whose time ran out (a worker's chore: it queues their turns)."""
        try:
            await self.turns.approvals.sweep()
        except Exception:
            log.exception("the approval expiry sweep failed")
        return True

    def _wrote(self, tenant: str | None) -> None:
        """A Durable Streams append or creation (its script marked the subscriptions it
        concerns): this process's wake loop looks at once if the tenant has any."""
        if self.wakes is not None and tenant in self.subscriptions.known:
            self.wakes.nudge()

    async def trim_pools(self) -> bool:
        """Every ``BROKER_POOL_TRIM_S``, close the idle Redis connections a burst left (see
        trim_idle_connections); once a crowd of readers left (CrowdWatch), at once every idle
        one (the load since reopens what it needs), then the memory it freed (memory.give_back)."""
        now = time.monotonic()
        if crowd_left := self._crowd.left(self.hub.readers):
            await self._trim(keep=0, floor=0)
            give_back()  # after the trim: the closed connections' cycles go too
        if crowd_left or now - self._trimmed_at >= self.settings.pool_trim_s:
            await self._trim()
            self._trimmed_at = now
        return True

    async def _trim(self, keep: int = POOL_KEEP_IDLE, floor: int = POOL_MIN_IDLE) -> None:
        for redis in (self.redis, self.blocking_redis, self.replica_reads):
            try:
                closed = 0 if redis is None else await trim_idle_connections(redis, keep, floor)
            except Exception:
                log.exception("trimming a Redis connection pool failed")
                continue
            if closed:
                log.debug("closed %d idle Redis connections", closed)

    async def drain(self) -> None:
        """Stop work in the order that loses nothing; safe to call more than once."""
        if self._drained:
            return
        self._drained = True
        for periodic in (self._pool_trim, self._approval_sweep):
            if periodic is not None:
                await periodic.stop()
        if self.worker is not None:
            await self.worker.stop(self.settings.drain_timeout_s)
        if self.wakes is not None:
            await self.wakes.stop()
        if self.notifier is not None:  # after the worker: the attempts it ended are nudged
            await self.notifier.stop(min(self.settings.drain_timeout_s, WEBHOOK_DRAIN_S))
        await self.hub.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.drain()
        with contextlib.suppress(Exception):
            await self.http.aclose()
        await self.providers.aclose()
        for redis in (self.redis, self.blocking_redis, self.replica_reads):
            if redis is None:
                continue
            with contextlib.suppress(Exception):
                await redis.aclose()
        if self.embedded is not None:
            self.embedded.stop()


async def shared_attach_secret(redis: Redis, settings: Settings, secured: bool) -> bytes:
    """The key that signs attach tokens: ``BROKER_ATTACH_SECRET``, else one random key kept in
    Redis and shared by every broker process (whoever reaches Redis can read the streams anyway).

    An open broker and a secured one use different keys, so tokens that anyone could mint while
    the broker ran open are worthless once credentials are turned on.
    """
    if settings.attach_secret:
        return settings.attach_secret.encode()
    key = Keys(settings.key_prefix).attach_secret(secured)
    await redis.set(key, secrets.token_hex(32), nx=True)
    value = await rc.get(redis, key)
    if value is None:  # deleted between the two calls: try once more
        await redis.set(key, secrets.token_hex(32), nx=True)
        value = await rc.get(redis, key)
    assert value is not None
    return value.encode()


Layer = tuple[Callable[..., ASGIApp], dict[str, Any]]


def layers(settings: Settings) -> list[Layer]:
    """The app's middleware with their options, innermost first: FastAPI's stack and the stream
    reads' own (broker.api.stream_reads) are built from this one list."""
    found: list[Layer] = [
        (BodySizeLimit, {"limit": settings.max_body_bytes}),
        (HeaderSizeLimit, {"limit": settings.max_header_bytes}),
    ]
    if settings.compression == "on":  # gzip for clients that ask; streams code their own bodies
        found.append((Compression, {}))
    found.append((SecurityHeaders, {}))
    origins = cors_origins(settings.cors_origins)
    if origins:  # outermost, so that even a 413 or 431 is readable by the calling page
        options = {
            "allow_origins": origins,
            "allow_methods": ["GET", "POST", "PUT", "DELETE", "HEAD"],
            "allow_headers": [
                "Authorization",
                "Content-Type",
                "Last-Event-ID",
                *DS_REQUEST_HEADERS,
            ],
            "expose_headers": ["Retry-After", "WWW-Authenticate", *DS_RESPONSE_HEADERS],
            "max_age": 600,
        }
        found.append((CORSMiddleware, options))
    found.append((RawSend, {}))  # outermost: event streams write their bodies past the rest
    return found


def create_app(
    settings: Settings, runtime: Runtime | None = None, *, tools: ToolRegistry | None = None
) -> FrontDoor:
    """The ASGI app; its lifespan starts (unless given one) and stops the runtime.

    Its front door (:mod:`broker.api.stream_reads`) sends the SSE stream reads and the Durable
    Streams routes (:mod:`broker.dialects.durable.door`) to their own ASGI apps, the rest on."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime if runtime is not None else await Runtime.start(settings, tools)
        app.state.runtime = rt  # the assembly's own (the server's drain, the tests)
        app.state.services = rt.services  # the handlers'
        app.state.metrics = rt.metrics
        try:
            yield
        finally:
            await rt.close()

    app = FastAPI(
        title="Resumable stream broker",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # install_docs: Swagger UI from the installed package, not a CDN
        redoc_url=None,
    )
    install_error_handlers(app)
    install_components(app, settings)
    install_docs(app)
    app.include_router(ops_router)
    if settings.runs_api:
        app.include_router(api_router)
        app.include_router(openai_router)
        app.include_router(aisdk_router)
        app.include_router(durable_router)
        app.add_api_route("/", _demo_page, methods=["GET"], include_in_schema=False)
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    for layer, options in layers(settings):
        app.add_middleware(layer, **options)
    if not settings.runs_api:
        return FrontDoor(app, None)

    def layered(read: ASGIApp) -> ASGIApp:
        for layer, options in layers(settings):
            read = layer(read, **options)
        return read

    def found() -> Services:
        return cast(Services, app.state.services)

    reads = StreamReads(
        found,
        max_header_bytes=settings.max_header_bytes,
        compression=settings.compression == "on",
        cors=bool(cors_origins(settings.cors_origins)),
        layered=layered,
    )
    return FrontDoor(app, reads, [DurableDoor(app, found, layered, settings)])


def parser_header_limit(settings: Settings) -> int:
    """The HTTP parser's own header limit, above the broker's so that the broker's 431 is sent."""
    return settings.max_header_bytes + 65_536


def server_config(settings: Settings, app: ASGIApp) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: the broker's HTTP protocol (fast, or uvicorn's own
    when the fast path is off: :mod:`broker.fastpath`) and connection limits."""

    def count(reason: str) -> None:
        rt = _find_runtime(app)
        if rt is not None:
            rt.metrics.connections_closed.labels(reason).inc()

    def refused(cap: str) -> None:
        rt = _find_runtime(app)
        if rt is not None:
            rt.metrics.caller_refusals.labels(cap).inc()

    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        max_header_bytes=parser_header_limit(settings),
        max_connections=settings.max_connections,
        count=count,
        body_timeout_s=settings.body_timeout_s,
        per_address=settings.address_share,
        per_tenant=settings.tenant_share,
        uncapped=uncapped_addresses(settings.uncapped_networks),
        refused=refused,
        headers=tuple(COMMON),
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=http_protocol_class(limits, fast=probe(settings.fast_path).http),
        log_level=settings.log_level.lower(),
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
        access_log=False,
    )


async def _demo_page() -> FileResponse:
    """The demo page: a chat box on the browser client, showing answers that outlive connections."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


class Server(uvicorn.Server):
    """uvicorn's server, draining the broker before it waits for open connections to close.

    uvicorn waits for every open response before the lifespan shutdown runs; live streams would
    hold it for ever. Draining first ends them after their terminal events.
    """

    # True once startup has printed its address and set its gauges: startup writes nothing more
    # to stdout after this, so an in-process caller can wait for it instead of `started`.
    announced: bool = False
    # One of several processes on one listening socket (broker.workers): where to say it is
    # ready, instead of printing the address, which the supervisor prints once for all.
    ready_fd: int | None = None
    _counting: Periodic | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Handle SIGINT/SIGTERM as a graceful stop that exits 0 (uvicorn re-raises them)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first SIGINT or SIGTERM drains; a second SIGINT (Ctrl-C again) exits at once."""
        if self.should_exit and sig == signal.SIGINT:
            exit_now(_find_runtime(self.config.loaded_app))
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        rt = _find_runtime(self.config.loaded_app)
        if rt is not None:
            self._count_connections(rt.metrics)
        if self.started and self.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, b"ready\n")
            os.close(self.ready_fd)
        elif self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in str(host) else host
            print(f"broker serving on http://{shown}:{port}", flush=True)
        self.announced = self.started

    def _count_connections(self, metrics: Metrics) -> None:
        """The open connections gauge: read at each scrape, or with several processes (whose
        gauges are files) written every second."""
        connections = self.server_state.connections
        if metrics.shared_directory is None:
            metrics.http_connections.set_function(lambda: len(connections))
            return

        async def count() -> bool:
            metrics.http_connections.set(len(connections))
            return True

        self._counting = Periodic(count, 1.0, name="connections gauge", first_s=0)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._counting is not None:
            await self._counting.stop()
        rt = _find_runtime(self.config.loaded_app)
        if rt is not None:
            try:
                await asyncio.wait_for(rt.drain(), rt.settings.drain_timeout_s + 10)
            except TimeoutError:
                log.warning("drain did not finish in time; closing connections anyway")
        await super().shutdown(sockets)


def exit_now(rt: Runtime | None) -> NoReturn:
    """Leave without the drain: to Redis, a crash (running generations keep their leases until
    they run out, then another worker takes them over, as after a SIGKILL). Only the embedded
    server is stopped first, so that neither it nor its directory outlives the broker."""
    print("broker: interrupted again: exiting without the drain", file=sys.stderr, flush=True)
    if rt is not None and rt.embedded is not None:
        rt.embedded.stop()
    sys.stdout.flush()
    os._exit(130)  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


def _find_runtime(app: object) -> Runtime | None:
    seen = 0
    while app is not None and seen < 20:
        state = getattr(app, "state", None)
        rt = getattr(state, "runtime", None) if state is not None else None
        if isinstance(rt, Runtime):
            return rt
        app = getattr(app, "app", None)
        seen += 1
    return None
