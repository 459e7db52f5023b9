"""Workers: take generation jobs from the Redis job stream and write each turn under a lease.

Jobs sit in a consumer group until the turn's attempt is finished, so a worker that dies leaves
its job pending; another worker takes it over with XAUTOCLAIM once it has been idle longer than
``BROKER_JOB_RECLAIM_IDLE_MS``. A live worker keeps its job's idle time low with the same
heartbeat that renews its lease, and the lease (not the job) decides who may write: a takeover
mints a new fencing token, after which the old writer's appends are refused by Lua.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from broker import redis_calls as rc
from broker.errors import FencedWrite, StreamFull
from broker.keys import JOB_GROUP, Keys
from broker.lease import TurnWriter
from broker.metrics import Metrics
from broker.providers import (
    Finished,
    GenerationRequest,
    Providers,
    TextDelta,
    UpstreamError,
    Usage,
)
from broker.scripts import Scripts
from broker.settings import Settings

log = logging.getLogger("broker.worker")


async def enqueue(
    redis: Redis, keys: Keys, conversation_id: str, turn_id: str, attempt: int
) -> str:
    """Put a generation job for one attempt of a turn on the job stream."""
    job_id = await redis.xadd(
        keys.jobs, {"conversation_id": conversation_id, "turn_id": turn_id, "attempt": attempt}
    )
    return str(job_id)


async def ensure_group(redis: Redis, keys: Keys) -> None:
    """Create the workers' consumer group (and the job stream) if they do not exist yet."""
    try:
        await redis.xgroup_create(keys.jobs, JOB_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class _LeaseLost(Exception):
    """Raised into a generation whose lease heartbeat was refused."""


class Worker:
    """Runs generation jobs concurrently, up to ``BROKER_WORKER_CONCURRENCY`` at a time."""

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
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._shutting_down = False
        self._reclaim_cursor = "0-0"

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="broker-worker")

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop taking jobs, let running generations finish for a while, then interrupt them."""
        self._stopping.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._tasks:
            log.info(
                "draining: %d running generation(s) get %.0f s to finish before they are "
                "interrupted", len(self._tasks), drain_timeout_s,
            )  # fmt: skip
            _, pending = await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
            self._shutting_down = True
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def _run(self) -> None:
        log.info(
            "worker %s taking jobs (concurrency %d)", self.name, self._settings.worker_concurrency
        )
        loop = asyncio.get_running_loop()
        next_reclaim = 0.0
        while not self._stopping.is_set():
            try:
                free = self._settings.worker_concurrency - len(self._tasks)
                if free <= 0:
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + self._settings.job_reclaim_idle_ms / 2000
                    await self._reclaim(free)
                    free = self._settings.worker_concurrency - len(self._tasks)
                    if free <= 0:
                        continue
                jobs = await rc.xreadgroup(
                    self._redis, JOB_GROUP, self.name, self._keys.jobs, free, 1000
                )
                for job_id, fields in jobs:
                    self._spawn(job_id, fields)
            except (RedisError, OSError) as exc:
                self._metrics.redis_errors.inc()
                if "NOGROUP" in str(exc):  # the job stream was deleted (e.g. Redis lost its data)
                    with contextlib.suppress(RedisError, OSError):
                        await ensure_group(self._redis, self._keys)
                        continue
                log.warning("worker cannot read jobs: %s; retrying in 1 s", exc)
                await asyncio.sleep(1)
            except Exception:
                # Never let the job loop die quietly: a worker that takes no jobs looks healthy.
                log.exception("worker job loop failed; retrying in 1 s")
                await asyncio.sleep(1)

    async def _reclaim(self, count: int) -> None:
        """Take over jobs whose worker stopped refreshing them (crashed, frozen, partitioned)."""
        # Redis scans only COUNT x 10 pending entries per call: walk the whole list with a cursor,
        # or dead jobs behind many live ones would never be reached.
        cursor, claimed, deleted = await rc.xautoclaim(
            self._redis, self._keys.jobs, JOB_GROUP, self.name,
            self._settings.job_reclaim_idle_ms, count, self._reclaim_cursor,
        )  # fmt: skip
        self._reclaim_cursor = cursor
        for job_id, fields in claimed:
            if fields:
                log.info("reclaimed job %s of an idle worker", job_id)
                self._spawn(job_id, fields)
        for job_id in deleted:
            await self._done(job_id)  # deleted entries still pending: nothing to run

    def _spawn(self, job_id: str, fields: dict[str, str]) -> None:
        task = asyncio.create_task(self._handle(job_id, fields), name=f"job-{job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _done(self, job_id: str) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(self._keys.jobs, JOB_GROUP, job_id)
            pipe.xdel(self._keys.jobs, job_id)
            await pipe.execute()

    async def _handle(self, job_id: str, fields: dict[str, str]) -> None:
        try:
            conversation_id = fields["conversation_id"]
            turn_id = fields["turn_id"]
            attempt = int(fields["attempt"])
        except (KeyError, ValueError):
            log.error("dropping malformed job %s: %r", job_id, fields)
            await self._done(job_id)
            return
        try:
            finished = await self._run_attempt(job_id, conversation_id, turn_id, attempt)
        except (RedisError, OSError) as exc:
            # Redis went away mid-turn: leave the job pending; it is reclaimed when Redis is back.
            self._metrics.redis_errors.inc()
            log.warning("turn %s attempt %d stopped on a Redis error: %s", turn_id, attempt, exc)
            return
        if finished:
            with contextlib.suppress(RedisError, OSError):
                await self._done(job_id)

    async def _run_attempt(
        self, job_id: str, conversation_id: str, turn_id: str, attempt: int
    ) -> bool:
        """Claim and run one attempt; True when the job is settled and may be acknowledged."""
        settings = self._settings
        writer = TurnWriter(
            self._scripts, self._keys, self._metrics, conversation_id, turn_id,
            max_events=settings.max_stream_events, lease_ttl_ms=settings.lease_ttl_ms,
            retention_ms=int(settings.stream_ttl * 1000),
            tombstone_ms=int(settings.tombstone_ttl * 1000),
        )  # fmt: skip
        claim = await writer.claim(self.name, attempt)
        if claim.result in ("missing", "stale"):
            return True
        if claim.result == "held":
            return False  # a live worker owns the turn and refreshes its job itself
        generation = asyncio.create_task(
            self._generate(writer, conversation_id, turn_id, attempt, claim.previous_status)
        )
        lease_lost = asyncio.Event()
        heartbeat = asyncio.create_task(self._heartbeat(writer, job_id, generation, lease_lost))
        try:
            await generation
        except (_LeaseLost, asyncio.CancelledError) as exc:
            # A CancelledError is ours to handle only when the heartbeat cancelled the generation
            # for a lost lease; otherwise this job task itself is being cancelled (shutdown).
            if isinstance(exc, asyncio.CancelledError) and not lease_lost.is_set():
                raise
            self._metrics.fenced_writes.inc()
            log.warning("turn %s: lease lost, another worker owns it now", turn_id)
            return False
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        await self._refresh_index_ttl(conversation_id, turn_id)
        return True

    async def _heartbeat(
        self,
        writer: TurnWriter,
        job_id: str,
        generation: asyncio.Task[None],
        lease_lost: asyncio.Event,
    ) -> None:
        interval = self._settings.lease_heartbeat_s
        while True:
            await asyncio.sleep(interval)
            try:
                await writer.renew()
                # Resetting the job's idle time keeps other workers from reclaiming a live job.
                await self._redis.xclaim(
                    self._keys.jobs, JOB_GROUP, self.name, 0, [job_id], justid=True
                )
            except FencedWrite:
                lease_lost.set()
                generation.cancel(msg="lease lost")
                return
            except (RedisError, OSError) as exc:
                log.warning("lease heartbeat failed: %s", exc)

    async def _refresh_index_ttl(self, conversation_id: str, turn_id: str) -> None:
        keys, settings = self._keys, self._settings
        (stream_id,) = await rc.hmget(
            self._redis, keys.turn(conversation_id, turn_id), ["stream_id"]
        )
        ttl_ms = int((settings.stream_ttl + settings.tombstone_ttl) * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(keys.turn_index(turn_id), ttl_ms)
            if stream_id:
                pipe.pexpire(keys.stream_index(stream_id), ttl_ms)
            await pipe.execute()

    async def _generate(
        self,
        writer: TurnWriter,
        conversation_id: str,
        turn_id: str,
        attempt: int,
        previous_status: str,
    ) -> None:
        turn_key = self._keys.turn(conversation_id, turn_id)
        raw_request, raw_record = await self._redis.hmget(
            turn_key, ["request", f"attempt:{attempt}"]
        )
        request: dict[str, Any] = orjson.loads(raw_request or "{}")
        record: dict[str, Any] = orjson.loads(raw_record or "{}")
        strategy = str(record.get("strategy", "initial"))
        delivered = ""
        has_attempt_event = False
        try:
            if previous_status == "streaming":
                self._metrics.lease_takeovers.inc()
                has_attempt_event, delivered = await self._delivered(
                    conversation_id, turn_id, attempt
                )
                if delivered:
                    # A dead worker's answer already reached readers: never continue it silently.
                    log.info("turn %s: took over after a lost worker; interrupting", turn_id)
                    await writer.finish(
                        attempt=attempt, strategy=strategy, status="interrupted",
                        reason="worker_lost", text=delivered,
                    )  # fmt: skip
                    return
            await self._stream_attempt(
                writer, request, conversation_id, turn_id, attempt, strategy, has_attempt_event
            )
        except FencedWrite as exc:
            raise _LeaseLost() from exc

    async def _stream_attempt(
        self,
        writer: TurnWriter,
        request: dict[str, Any],
        conversation_id: str,
        turn_id: str,
        attempt: int,
        strategy: str,
        has_attempt_event: bool,
    ) -> None:
        provider = self._providers.get(request.get("provider"))
        if not has_attempt_event:
            await writer.append([("attempt", {"attempt": attempt, "strategy": strategy})])
        upstream_call = await self._redis.hincrby(
            self._keys.turn(conversation_id, turn_id), "upstream_calls", 1
        )
        generation = GenerationRequest(
            conversation_id=conversation_id, turn_id=turn_id, attempt=attempt, strategy=strategy,
            messages=request.get("messages", []), model=request.get("model"),
            params=request.get("params", {}),
            response_format=request.get("response_format", "text"),
            upstream_call=upstream_call - 1,
        )  # fmt: skip
        parts: list[str] = []
        finished = False
        outcome = "ok"

        async def end(status: str, reason: str | None, error: dict[str, Any] | None = None) -> None:
            before = [("error", {"attempt": attempt, **error})] if error else []
            await writer.finish(
                attempt=attempt, strategy=strategy, status=status, reason=reason,
                text="".join(parts), before_end=before,
            )  # fmt: skip

        try:
            async for event in provider.stream(generation):
                if isinstance(event, TextDelta):
                    if event.text:
                        await writer.append([("delta", {"attempt": attempt, "text": event.text})])
                        parts.append(event.text)
                elif isinstance(event, Usage):
                    await writer.append([("usage", {
                        "attempt": attempt, "input_tokens": event.input_tokens,
                        "output_tokens": event.output_tokens,
                    })])  # fmt: skip
                elif isinstance(event, Finished):
                    finished = True
                    break
            if not finished:
                outcome = "interrupted"
        except UpstreamError as exc:
            outcome = "retryable_error" if exc.retryable else "fatal_error"
            error = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
            if parts:
                outcome = "interrupted"
                await end("interrupted", "upstream_error", error)
            else:
                await end("failed", exc.code, error)
            return
        except StreamFull:
            await end("failed", "stream_limit", {
                "code": "stream_limit", "retryable": False,
                "message": f"the stream reached BROKER_MAX_STREAM_EVENTS="
                           f"{self._settings.max_stream_events}",
            })  # fmt: skip
            return
        except asyncio.CancelledError:
            if not self._shutting_down:
                raise
            await end("interrupted", "shutdown")
            raise
        except (FencedWrite, RedisError, OSError):
            # Lease lost, or Redis away: the job stays pending and a worker takes it over.
            raise
        except Exception:
            log.exception("turn %s attempt %d failed inside the broker", turn_id, attempt)
            outcome = "fatal_error"
            await end("failed", "internal", {
                "code": "internal", "retryable": False, "message": "the broker failed this attempt",
            })  # fmt: skip
            return
        finally:
            self._metrics.upstream_requests.labels(provider.name, outcome).inc()
        if finished:
            await end("complete", None)
        else:
            await end("interrupted", "upstream_error", {
                "code": "upstream_incomplete", "retryable": True,
                "message": "the upstream stream ended without its terminal event",
            })  # fmt: skip

    async def _delivered(
        self, conversation_id: str, turn_id: str, attempt: int
    ) -> tuple[bool, str]:
        """Whether this attempt's ``attempt`` event is on the stream, and its delivered text."""
        key = self._keys.events(conversation_id, turn_id)
        has_attempt_event = False
        text: list[str] = []
        start = "-"
        while True:
            page = await rc.xrange(self._redis, key, start)
            if not page:
                break
            for _entry_id, fields in page:
                data = orjson.loads(fields.get("d", "{}"))
                if data.get("attempt") != attempt:
                    continue
                if fields.get("e") == "attempt":
                    has_attempt_event = True
                elif fields.get("e") == "delta":
                    text.append(str(data.get("text", "")))
            start = "(" + page[-1][0]
        return has_attempt_event, "".join(text)
