"""Workers: take generation jobs from the Redis job partitions and write each turn under a lease.

A worker consumes every partition of the job queue (:class:`broker.jobs.JobQueue` reads them all
in one call) and settles each job on the partition it came from. Jobs sit in a consumer group
until the turn's attempt is finished, so a worker that dies leaves its job pending; another
worker takes it over with XAUTOCLAIM (each partition in turn) once it has been idle longer than
the lease (``BROKER_JOB_RECLAIM_IDLE_MS``, by default the lease TTL plus 500 ms). A live worker
keeps its job's idle time low with the same heartbeat that renews its lease, and the lease (not
the job) decides who may write: a takeover mints a new fencing token, after which the old
writer's appends are refused by Lua.

A worker whose attempt stops on a Redis error (a restart, a failover) runs it again itself, with
backoff, instead of leaving it to the reclaim: the claim, the appends and the finish are safe
to send twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.admission import Admission
from broker.connection import drop_idle_connections
from broker.deps import Deps
from broker.errors import FencedWrite, LeaseLost
from broker.generation import LEASE_LOST, SHUTDOWN, STOP, Generation, Run
from broker.jobs import Job, JobQueue
from broker.lease import TurnWriter
from broker.ledger import Dispatcher
from broker.periodic import Periodic
from broker.providers import Providers
from broker.retry import RetryPolicy
from broker.vocabulary import scoped, unscoped

log = logging.getLogger("broker.worker")

# A live turn's stream slot lasts LIVE_SLOT_TTL_MS (10 minutes): refresh it now and then.
SLOT_REFRESH_S = 60.0


class Worker:
    """Runs generation jobs concurrently, up to ``BROKER_WORKER_CONCURRENCY`` at a time."""

    def __init__(
        self,
        deps: Deps,
        blocking_redis: Redis,
        providers: Providers,
        jobs: JobQueue,
        dispatcher: Dispatcher | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._deps = deps
        self._redis = deps.redis
        self._admission = admission or Admission(deps)
        self._dispatcher = dispatcher
        self._blocking_redis = blocking_redis
        self._jobs = jobs
        self._settings = deps.settings
        self._providers = providers
        self._metrics = deps.metrics
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._runs: dict[tuple[str, str], Run] = {}
        # Turns a task of this worker is claiming or running: a second job of the same turn (a
        # duplicate enqueue) waits for its reclaim instead of claiming the lease this worker
        # holds, which claim_lease.lua would grant it.
        self._active: set[tuple[str, str]] = set()
        self._retry = RetryPolicy(deps)
        self._listener: asyncio.Task[None] | None = None
        # Called with (conversation_id, turn_id, attempt) when a job's attempt is over here (the
        # completion webhooks' nudge); it must not block.
        self.on_attempt_ended: Callable[[str, str, int], None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="broker-worker")
        self._listener = asyncio.create_task(self._listen_for_stops(), name="broker-stops")

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop taking jobs, let running generations finish for a while, then interrupt them."""
        self._stopping.set()
        for task in (self._loop_task, self._listener):
            if task is not None:
                task.cancel()
                await asyncio.wait([task])
        if self._tasks:
            log.info(
                "draining: %d running generation(s) get %.0f s to finish before they are "
                "interrupted",
                len(self._tasks),
                drain_timeout_s,
            )
            _, pending = await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
            for run in list(self._runs.values()):
                run.request_stop(SHUTDOWN)  # each writes its `end` (interrupted, shutdown)
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
                    next_reclaim = loop.time() + self._settings.reclaim_every_s
                    await self._reclaim(free)
                    free = self._settings.worker_concurrency - len(self._tasks)
                    if free <= 0:
                        continue
                for job in await self._jobs.read(self.name, free, 1000, self._stopping):
                    self._spawn(job)
            except (RedisError, OSError) as exc:
                self._metrics.redis_errors.inc()
                if "NOGROUP" in str(exc):  # job streams were deleted (e.g. Redis lost its data)
                    with contextlib.suppress(RedisError, OSError):
                        await self._jobs.ensure_group()
                        continue
                log.warning("worker cannot read jobs: %s; retrying in 0.2 s", exc)
                with contextlib.suppress(RedisError, OSError):
                    await drop_idle_connections(self._redis)
                await asyncio.sleep(0.2)
            except Exception:
                # Never let the job loop die quietly: a worker that takes no jobs looks healthy.
                log.exception("worker job loop failed; retrying in 1 s")
                await asyncio.sleep(1)

    async def _reclaim(self, count: int) -> None:
        """Take over jobs whose worker stopped refreshing them (crashed, frozen, partitioned)."""
        for job in await self._jobs.reclaim(self.name, self._settings.reclaim_idle_ms, count):
            if (job.conversation_id, job.turn_id) in self._runs:
                continue  # this worker runs it: its heartbeat missed a beat (Redis away)
            log.info("reclaimed job %s of an idle worker from %s", job.job_id, job.stream)
            self._spawn(job)

    async def _hand_back(self, job: Job) -> None:
        """Make a handed-back job look abandoned at once, so that the next reclaim pass (of any
        worker, or of this one's successor, which reclaims as it starts) takes it."""
        await self._jobs.hand_back(self.name, job, self._settings.reclaim_idle_ms)

    def _spawn(self, job: Job) -> None:
        task = asyncio.create_task(self._handle(job), name=f"job-{job.job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, job: Job) -> None:
        try:
            finished = await self._run_again_on_redis_errors(job)
        except (RedisError, OSError) as exc:
            # Redis stayed away: leave the job pending; it is reclaimed when Redis is back.
            self._metrics.redis_errors.inc()
            log.warning(
                "turn %s attempt %d stopped on a Redis error: %s; left for a reclaim",
                job.turn_id,
                job.attempt,
                exc,
            )
            return
        finally:
            # Whatever happened, an attempt that is no longer live frees its tenant's slot.
            await self._admission.release_if_done(job.conversation_id, job.turn_id, job.attempt)
        if finished:
            with contextlib.suppress(RedisError, OSError):
                await self._jobs.done(job)
            if self.on_attempt_ended is not None:
                self.on_attempt_ended(job.conversation_id, job.turn_id, job.attempt)

    async def _run_again_on_redis_errors(self, job: Job) -> bool:
        """:meth:`_run_attempt`, run again at once (with jittered backoff) when it stopped on a
        Redis error, for as long as a reclaim would take; then the error is raised.

        The attempt takes itself over as another worker would (the retry policy decides what a
        taken-over attempt may do), only without waiting for its job to idle.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.reclaim_idle_s
        delay = 0.05
        while True:
            try:
                return await self._run_attempt(job)
            except (RedisError, OSError) as exc:
                if self._stopping.is_set() or loop.time() + delay > deadline:
                    raise
                self._metrics.redis_errors.inc()
                log.warning(
                    "turn %s attempt %d stopped on a Redis error (%s): running it again",
                    job.turn_id,
                    job.attempt,
                    exc,
                )
                with contextlib.suppress(RedisError, OSError):
                    await drop_idle_connections(self._redis)
                await asyncio.sleep(random.uniform(0, delay))
                delay = min(delay * 2, 1.0)

    async def _run_attempt(self, job: Job) -> bool:
        """Claim and run one attempt; True when the job is settled and may be acknowledged."""
        turn = (job.conversation_id, job.turn_id)
        if turn in self._active:
            return False  # held by another task of this worker, which settles it
        self._active.add(turn)
        try:
            return await self._claim_and_run(job)
        finally:
            self._active.discard(turn)

    async def _claim_and_run(self, job: Job) -> bool:
        job_id, conversation_id, turn_id = job.job_id, job.conversation_id, job.turn_id
        if job.resumed and not await self._admission.hold(conversation_id, turn_id, job.attempt):
            # Its tenant runs as many streams as it may (a resumed approval gave its slot
            # back while it waited): the job goes back, and a reclaim pass tries again.
            log.info("turn %s attempt %d waits for a stream slot", turn_id, job.attempt)
            await self._hand_back(job)
            return False
        writer = TurnWriter(self._deps, conversation_id, turn_id)
        claim = await writer.claim(self.name, job.attempt)
        if claim.result in ("missing", "stale"):
            return True
        if claim.result == "held":
            return False  # a live worker owns the turn and refreshes its job itself
        run = Run(conversation_id, turn_id, job.attempt, job_id, writer, claim)
        generation = Generation(self._deps, self._providers, self._retry, run, self._dispatcher)
        run.task = asyncio.create_task(generation.run(), name=f"turn {turn_id}")
        self._runs[(conversation_id, turn_id)] = run
        period = self._settings.lease_heartbeat_s
        heartbeat = Periodic(
            lambda: self._heartbeat(run, job),
            period,
            name=f"lease {turn_id}",
            # Turns started in a burst renew at spread times, not all at once (each renewal
            # in flight holds a Redis connection): the first comes early, never late.
            first_s=period * random.uniform(0.5, 1.0),
        )
        try:
            await self._jobs.watch_stops(conversation_id)  # a cluster's channel of its own
            try:
                await run.task
            except asyncio.CancelledError:
                if run.stop in (STOP, SHUTDOWN) and not generation.started:
                    # Stopped before its first step: no handler inside ran, so end it here.
                    await generation.end_unstarted(run.stop)
                    if run.stop == SHUTDOWN:
                        raise
                elif run.stop != LEASE_LOST:
                    raise  # this job task itself is being cancelled (shutdown)
                else:
                    raise LeaseLost() from None
        except LeaseLost:
            self._metrics.fenced_writes.inc()
            log.warning("turn %s: lease lost, another worker owns it now", turn_id)
            return False
        finally:
            if self._runs.get((conversation_id, turn_id)) is run:
                del self._runs[(conversation_id, turn_id)]
            await heartbeat.stop()
            await self._jobs.unwatch_stops(conversation_id)
            if generation.handed_back:
                await self._hand_back(job)
        await self._refresh_index_ttl(conversation_id, turn_id)
        return True

    async def _heartbeat(self, run: Run, job: Job) -> bool:
        """Renew the lease and keep the job fresh; False once the lease is lost."""
        try:
            if await run.writer.renew():
                run.request_stop(STOP)  # a stop whose notification we missed
            await self._jobs.touch(self.name, job)  # so no other worker reclaims it
            if time.monotonic() - run.slot_refreshed > SLOT_REFRESH_S:
                await self._admission.refresh(run.conversation_id, run.turn_id, run.attempt)
                run.slot_refreshed = time.monotonic()
        except FencedWrite:
            self._metrics.lease_expirations.inc()
            run.request_stop(LEASE_LOST)
            return False
        except (RedisError, OSError) as exc:
            log.warning("lease heartbeat failed: %s", exc)
        return True

    async def _listen_for_stops(self) -> None:
        """Stop requests are published so they reach this worker at once, wherever it runs
        (and on a cluster, the same subscription hears the job partitions' doorbells)."""
        await self._jobs.listen(self._blocking_redis, self._on_stop, self._stopping)

    def _on_stop(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        run = self._runs.get((conversation_id, turn_id))
        # A late message must not stop the attempt that followed the one it meant.
        if run is not None and run.attempt == attempt:
            run.request_stop(STOP)

    async def _refresh_index_ttl(self, conversation_id: str, turn_id: str) -> None:
        keys = self._deps.keys
        turn_key = keys.turn(conversation_id, turn_id)
        (stream_id,) = await rc.hmget(self._redis, turn_key, ["stream_id"])
        ttl_ms = self._settings.index_ttl_ms
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(keys.turn_index(scoped(unscoped(conversation_id)[0], turn_id)), ttl_ms)
            if stream_id:
                pipe.pexpire(keys.stream_index(stream_id), ttl_ms)
            await pipe.execute()
