"""Completion webhooks, the worker side: send each watched attempt's notification once it is at
rest, signed, retried with backoff, at least once.

Each notification is a job of the ``webhooks`` queue (:mod:`broker.webhooks`), pending in the
workers' consumer group from the moment its attempt was queued. A worker reads new jobs and,
every ``BROKER_WEBHOOK_RECHECK_MS``, takes over (``XAUTOCLAIM``) those idle that long, whoever
read them: so a job is looked at again about that often by some live worker, and a worker that
dies mid-way leaves nothing behind. For each job it reads the turn: while the attempt runs,
the job is left pending; once the attempt is at rest, ``take_webhook.lua`` stores the body
(taken from the turn then, and sent unchanged on every try), holds the job for the length of
one send, and the worker POSTs it.

* A 2xx settles it: the turn is marked (``webhook_sent:<attempt>``, so that a duplicate job of
  the same attempt is settled unsent), the job acknowledged and deleted.
* Anything else (an error status, a timeout, a refused connection) counts a try and holds the
  job for a capped, jittered exponential backoff (``BROKER_WEBHOOK_BACKOFF_MS`` doubled per
  try up to ``BROKER_WEBHOOK_BACKOFF_MAX_MS``, each pause drawn from its upper half); after
  ``BROKER_WEBHOOK_MAX_TRIES`` it is given up, with a log line and a metric.
* A per-turn URL is checked again before each send (:func:`pinned_target`): its host and port
  against ``BROKER_WEBHOOK_HOSTS``, then every address its name resolves to; the send connects
  to the address checked (the URL's name kept as Host and TLS server name), so a DNS answer that
  changes between the check and the connection cannot send it elsewhere. A refused URL is given
  up at once, logged and counted (``broker_webhook_refusals_total{reason}``).
* A crash during a send leaves the job pending and held; once the hold runs out (the send
  timeout, and as long again up to 5 s) the next look sends it again. Receivers deduplicate by
  ``webhook-id``.

A job that names an approval (an approval request's, ``approval.requested``) waits for nothing:
its body is made from the turn and the approval's hash the first time it is taken, and it goes
through the same take, send, backoff and settle as an attempt's, its own ``webhook-id`` and sent
marker keyed by the approval id.

A worker that ends an attempt nudges (:meth:`Notifier.nudge`): the job, found by the id kept on
the turn, is taken at once, wherever it was pending, so a notification normally leaves within
milliseconds of the end; the periodic look is what makes it certain.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import logging
import os
import random
import secrets
import socket
import time
import urllib.parse
from typing import Any, cast

import httpx
import orjson
from redis.exceptions import RedisError

from broker import __version__
from broker import redis_calls as rc
from broker.deps import Deps
from broker.jobs import Job, JobQueue
from broker.keys import JOB_GROUP
from broker.offsets import from_entry_id
from broker.scripts import WebhookTake
from broker.vocabulary import FINAL_STATUSES, AttemptStatus, TurnStatus, unscoped
from broker.webhook_config import RefusalReason, WebhookConfig, sign, webhook_id

log = logging.getLogger("broker.notifier")

# Jobs one worker looks at at once, and of those, sends in flight at once.
MAX_TASKS = 512
MAX_SENDS = 32
# A send holds its job at most this long past its timeout before another worker may send it.
HOLD_MARGIN_MS = 5_000
# How far back from a stream's end an attempt's `end` event is looked for (pages of events).
END_SCAN_PAGE = 16
END_SCAN_PAGES = 8
EVENT_TYPE = "turn.finished"
APPROVAL_EVENT_TYPE = "approval.requested"
USER_AGENT = f"resumable-stream-broker/{__version__} (completion webhook)"

# The turn status an attempt's own status stands for, once a later attempt has started.
TURN_STATUS_OF = {
    AttemptStatus.COMPLETE: TurnStatus.COMPLETE,
    AttemptStatus.PARTIAL: TurnStatus.INTERRUPTED,
    AttemptStatus.CANCELLED: TurnStatus.CANCELLED,
    AttemptStatus.FAILED: TurnStatus.FAILED,
    AttemptStatus.REQUIRES_ACTION: TurnStatus.REQUIRES_ACTION,
}


def iso_ms(ms: int) -> str:
    """A time in ms since the epoch as the notifications' ``timestamp`` (UTC, to the ms)."""
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def backoff_ms(failed: int, first_ms: int, max_ms: int) -> int:
    """The pause after ``failed`` failed sends: ``first_ms`` doubled per further failure, capped
    at ``max_ms``, and drawn from the upper half of that (workers never retry in step, never
    at once)."""
    ceiling = min(max_ms, first_ms << min(max(failed - 1, 0), 40))
    return max(1, round(ceiling * random.uniform(0.5, 1.0)))


class WebhookRefused(Exception):
    """A per-turn URL the rules refuse at send time; ``reason`` is the metric's label."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where one send goes: the URL to connect to, and the Host header and TLS server name of
    the URL it stands for (None: the URL's own)."""

    url: str
    host: str | None = None
    sni_hostname: str | None = None


async def pinned_target(url: str, config: WebhookConfig, timeout_s: float) -> Target:
    """The target of a send to ``url``: an operator's URL as written; a per-turn one checked
    (``WebhookRefused``), its name resolved (``OSError`` or ``TimeoutError`` when it does not),
    every address checked, and the first one connected to, so that the connection goes where
    the check looked."""
    if url in config.operator_urls:
        return Target(url)
    parts = urllib.parse.urlsplit(url)
    refusal = config.url_refusal(parts)
    if refusal is not None:
        raise WebhookRefused(*refusal)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(info[4][0]) for info in found]
    if not addresses:
        raise OSError(f"{host} has no address")
    for address in addresses:
        kind = config.address_refusal(address)
        if kind is not None:
            message = config.address_message(host, kind)
            raise WebhookRefused("address", f"{message} (it resolved to {address})")
    pinned = httpx.URL(url).copy_with(host=str(addresses[0]))
    tls_name = host if parts.scheme.lower() == "https" else None
    return Target(str(pinned), parts.netloc, tls_name)


def hold_ms(timeout_s: float) -> int:
    """How long a send holds its job: its timeout, and as long again (at most 5 s) for the
    answer to be recorded, before another worker may send it."""
    timeout_ms = int(timeout_s * 1000)
    return timeout_ms + min(HOLD_MARGIN_MS, timeout_ms)


class Notifier:
    """Sends the completion webhooks of one process's worker."""

    def __init__(
        self, deps: Deps, queue: JobQueue, http: httpx.AsyncClient, config: WebhookConfig
    ) -> None:
        self._redis = deps.redis
        self._keys = deps.keys
        self._scripts = deps.scripts
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._queue = queue
        self._http = http
        self._config = config
        if config.key is None:
            raise ValueError("a notifier needs BROKER_WEBHOOK_SECRET")
        self._key = config.key
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}-webhooks"
        self._tasks: dict[str, asyncio.Task[None]] = {}  # job id -> the task looking at it
        self._nudges: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()  # retries due here after their backoff
        self._sends = asyncio.Semaphore(MAX_SENDS)
        self._stopping = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="broker-webhooks")

    async def stop(self, timeout_s: float) -> None:
        """Stop taking jobs; sends in flight get ``timeout_s`` to finish, then are cut (their
        jobs stay pending and are sent again once their hold runs out)."""
        self._stopping.set()
        for timer in self._timers:
            timer.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        running = [*self._tasks.values(), *self._nudges]
        if running:
            _, pending = await asyncio.wait(running, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    def nudge(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """An attempt has ended here: take its notification now rather than at the next look."""
        if self._stopping.is_set():
            return
        task = asyncio.create_task(self._take_now(conversation_id, turn_id, attempt))
        self._nudges.add(task)
        task.add_done_callback(self._nudges.discard)

    async def _take_now(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        turn_key = self._keys.turn(conversation_id, turn_id)
        try:
            job_id = await rc.hget(self._redis, turn_key, f"webhook_job:{attempt}")
            if job_id is None or job_id in self._tasks:
                return  # not watched, or being looked at here already
            job = await self._queue.claim(self.name, self._queue.stream_of(conversation_id), job_id)
        except (RedisError, OSError) as exc:
            log.debug("webhook nudge for turn %s failed (%s); the next look sends it", turn_id, exc)
            return
        if job is not None:
            self._spawn(job)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        recheck_s = self._settings.webhook_recheck_ms / 1000
        next_look = 0.0
        while not self._stopping.is_set():
            try:
                free = MAX_TASKS - len(self._tasks)
                if free <= 0:
                    await asyncio.wait(
                        set(self._tasks.values()), return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                if loop.time() >= next_look:
                    idle_ms = self._settings.webhook_recheck_ms
                    jobs = await self._queue.reclaim(self.name, idle_ms, free)
                    # A full batch means more are waiting: look again at once.
                    next_look = loop.time() + (0 if len(jobs) >= free else recheck_s)
                    for job in jobs:
                        self._spawn(job)
                    continue
                block_ms = max(1, int((next_look - loop.time()) * 1000))
                for job in await self._queue.read(self.name, free, block_ms, self._stopping):
                    self._spawn(job)
            except (RedisError, OSError) as exc:
                self._metrics.redis_errors.inc()
                if "NOGROUP" in str(exc):  # the streams were lost with Redis's data
                    with contextlib.suppress(RedisError, OSError):
                        await self._queue.ensure_group()
                        continue
                log.warning("cannot read webhook jobs: %s; retrying in 0.2 s", exc)
                await asyncio.sleep(0.2)
            except Exception:
                # Never let the loop die quietly: notifications would wait for a restart.
                log.exception("webhook loop failed; retrying in 1 s")
                await asyncio.sleep(1)

    def _spawn(self, job: Job) -> None:
        if job.job_id in self._tasks or self._stopping.is_set():
            return
        task = asyncio.create_task(self._handle(job), name=f"webhook-{job.job_id}")
        self._tasks[job.job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.job_id, None))

    async def _handle(self, job: Job) -> None:
        try:
            await self._deliver(job)
        except (RedisError, OSError) as exc:
            # Left pending (and held, if taken): the next look, here or elsewhere, goes on.
            self._metrics.redis_errors.inc()
            log.warning(
                "webhook of turn %s attempt %d: Redis error %s", job.turn_id, job.attempt, exc
            )
        except Exception:
            log.exception("webhook of turn %s attempt %d failed", job.turn_id, job.attempt)

    async def _deliver(self, job: Job) -> None:
        """Look at one job: leave it while its attempt runs, else send it unless it is held."""
        if job.approval_id is not None:
            await self._deliver_approval(job, job.approval_id)
            return
        turn_key = self._keys.turn(job.conversation_id, job.turn_id)
        n = job.attempt
        values = await rc.hmget(
            self._redis,
            turn_key,
            ["status", "attempt", "stream_id", "notify", "canonical", f"attempt:{n}"],
        )
        meta = dict(
            zip(
                ("status", "attempt", "stream", "notify", "canonical", "record"),
                values,
                strict=True,
            )
        )
        body, url, ended_ms = "", "", 0
        if meta["status"] is not None:
            snapshot = await self._snapshot(job, meta)
            if snapshot is None:
                return  # the attempt runs: looked at again later, or nudged when it ends
            body, url, ended_ms = snapshot
            if not url:
                await self._give_up(job, 0, "its turn has no webhook target any more")
                return
        # An expired turn leaves only a notification taken before, sent with its stored body.
        await self._take_and_send(job, body, url, ended_ms)

    async def _deliver_approval(self, job: Job, approval_id: str) -> None:
        """Send the notification of an approval request at once (its body taken the first
        time); one whose turn or request is gone before it was taken is given up."""
        keys = self._keys
        status, stream_id, attempt, notify = await rc.hmget(
            self._redis,
            keys.turn(job.conversation_id, job.turn_id),
            ["status", "stream_id", "attempt", "notify"],
        )
        approval_key = keys.approval(job.conversation_id, job.turn_id, approval_id)
        request, requested_ms, expires_ms = await rc.hmget(
            self._redis, approval_key, ["request", "requested_ms", "expires_ms"]
        )
        body, url, ms = "", "", 0
        if status is not None and request is not None:
            tenant, conversation_id = unscoped(job.conversation_id)
            row: dict[str, Any] = orjson.loads(request)
            ms = int(requested_ms or time.time() * 1000)
            data = {
                "turn_id": job.turn_id,
                "conversation_id": conversation_id,
                "tenant": tenant,
                "stream_id": stream_id,
                "attempt": int(attempt or 0),
                "approval_id": approval_id,
                "name": row.get("tool"),
                "ordinal": row.get("ordinal"),
                "expires_at": int(expires_ms or 0) / 1000,
            }
            body = orjson.dumps(
                {"type": APPROVAL_EVENT_TYPE, "timestamp": iso_ms(ms), "data": data}
            ).decode()
            url = self._target(tenant, notify)
        await self._take_and_send(job, body, url, ms)

    async def _take_and_send(self, job: Job, body: str, url: str, ended_ms: int) -> None:
        """Take the job (``take_webhook.lua``) and send what it holds, unless it was delivered
        (settled unsent) or is held; one with nothing to send is given up."""
        keys = self._keys
        take = await self._scripts.take_webhook(
            delivery=keys.webhook_try(job.stream, job.job_id),
            hold=keys.webhook_hold(job.stream, job.job_id),
            sent=keys.webhook_sent(
                job.stream, job.conversation_id, job.turn_id, job.attempt, job.approval_id
            ),
            body=body,
            url=url,
            ended_ms=ended_ms,
            hold_ms=hold_ms(self._settings.webhook_timeout_s),
            ttl_ms=self._settings.stream_ttl_ms,
        )
        if take.result == "sent":
            await self._settle(job, sent=False)  # a second job of a delivered attempt
            return
        if take.result == "wait":
            return
        if not take.body or not take.url:
            await self._give_up(job, take.tries, "its turn expired, or has no target any more")
            return
        await self._send_taken(job, take)

    async def _send_taken(self, job: Job, take: WebhookTake) -> None:
        """Send a taken notification, then settle it, hold it for a retry, or give it up."""
        stream_id = str(orjson.loads(take.body)["data"]["stream_id"])
        msg_id = webhook_id(stream_id, job.attempt)
        if job.approval_id is not None:  # one per approval request
            msg_id = f"msg_{stream_id}_{job.approval_id}"
        host = urllib.parse.urlsplit(take.url).hostname or "?"
        tries = take.tries + 1
        try:
            async with self._sends:
                failure = await self._send(take.url, msg_id, take.body.encode())
        except WebhookRefused as refused:
            # Nothing was sent: the URL names (or resolves to) what webhooks may not reach.
            self._metrics.webhook_refusals.labels(refused.reason).inc()
            await self._give_up(job, take.tries, f"refused: {refused.message}")
            return
        if failure is None:
            await self._settle(job, sent=True)
            self._metrics.webhook_deliveries.labels("delivered").inc()
            waited_s = max(0.0, time.time() - take.ended_ms / 1000)
            self._metrics.webhook_delivery_seconds.observe(waited_s)
            log.info(
                "webhook %s of turn %s delivered to %s (try %d)",
                msg_id,
                job.turn_id,
                host,
                tries,
                extra={
                    "event": "webhook_delivered",
                    "turn_id": job.turn_id,
                    "attempt": job.attempt,
                },
            )
            return
        if tries >= self._settings.webhook_max_tries:
            await self._give_up(job, tries, f"{host} {failure}")
            return
        settings = self._settings
        delay_ms = backoff_ms(tries, settings.webhook_backoff_ms, settings.webhook_backoff_max_ms)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._keys.webhook_try(job.stream, job.job_id), "tries", tries)
            pipe.set(self._keys.webhook_hold(job.stream, job.job_id), "1", px=delay_ms)
            await pipe.execute()
        self._metrics.webhook_deliveries.labels("retried").inc()
        self._look_again(job, delay_ms)
        log.info(
            "webhook %s of turn %s: %s %s (try %d of %d); next try in %.1f s",
            msg_id,
            job.turn_id,
            host,
            failure,
            tries,
            self._settings.webhook_max_tries,
            delay_ms / 1000,
        )

    def _look_again(self, job: Job, delay_ms: int) -> None:
        """Look at a job again once its backoff is over, rather than at the next reclaim (which
        still finds it if this process is gone by then)."""

        def due() -> None:
            self._timers.discard(handle)
            self._spawn(job)

        handle = asyncio.get_running_loop().call_later(delay_ms / 1000, due)
        self._timers.add(handle)

    async def _send(self, url: str, msg_id: str, body: bytes) -> str | None:
        """POST one signed notification; None on a 2xx, else what went wrong (for the log).
        Raises ``WebhookRefused`` when the URL may not be sent to."""
        timeout = self._settings.webhook_timeout_s
        try:
            target = await pinned_target(url, self._config, timeout)
        except (OSError, TimeoutError, UnicodeError) as exc:
            return f"failed: cannot resolve its host ({type(exc).__name__})"
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self._key, msg_id, timestamp, body),
        }
        if target.host is not None:
            headers["host"] = target.host
        extensions = {} if target.sni_hostname is None else {"sni_hostname": target.sni_hostname}
        try:
            # Streamed and closed unread: a receiver's answer body is of no interest.
            async with self._http.stream(
                "POST",
                target.url,
                content=body,
                headers=headers,
                timeout=timeout,
                extensions=extensions,
            ) as response:
                if 200 <= response.status_code < 300:
                    return None
                return f"answered {response.status_code}"
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return f"failed: {type(exc).__name__}"

    async def _give_up(self, job: Job, tries: int, why: str) -> None:
        await self._settle(job, sent=False)
        self._metrics.webhook_deliveries.labels("gave_up").inc()
        log.warning(
            "webhook of turn %s attempt %d given up after %d tries: %s",
            job.turn_id,
            job.attempt,
            tries,
            why,
            extra={"event": "webhook_gave_up", "turn_id": job.turn_id, "attempt": job.attempt},
        )

    async def _settle(self, job: Job, *, sent: bool) -> None:
        """Acknowledge and delete the job and its delivery state (all in its partition's slot);
        ``sent`` marks the attempt delivered, so a duplicate job is settled unsent."""
        keys, stream = self._keys, job.stream
        async with self._redis.pipeline(transaction=False) as pipe:
            if sent:
                marker = keys.webhook_sent(
                    stream, job.conversation_id, job.turn_id, job.attempt, job.approval_id
                )
                pipe.set(marker, "1", px=self._settings.stream_ttl_ms)
            pipe.xack(stream, JOB_GROUP, job.job_id)
            pipe.xdel(stream, job.job_id)
            pipe.delete(keys.webhook_try(stream, job.job_id), keys.webhook_hold(stream, job.job_id))
            await pipe.execute()

    async def _snapshot(self, job: Job, meta: dict[str, str | None]) -> tuple[str, str, int] | None:
        """The notification of an attempt at rest (its JSON body, its URL or "" for none, the
        attempt's end in ms); None while the attempt runs."""
        n = job.attempt
        current = int(meta["attempt"] or 0)
        record: dict[str, Any] = orjson.loads(meta["record"] or "{}")
        if current < n or (current == n and meta["status"] not in FINAL_STATUSES):
            return None
        if current == n:
            status = str(meta["status"])
        else:  # a later attempt started: this one's own record says how it ended
            status = str(TURN_STATUS_OF.get(record.get("status", ""), record.get("status")))
        canonical = meta["canonical"] or None
        text_length = 0
        if canonical is not None:
            turn_key = self._keys.turn(job.conversation_id, job.turn_id)
            text_length = len(await rc.hget(self._redis, turn_key, f"text:{canonical}") or "")
        end_id = await self._end_of(job)
        ended_ms = int(end_id.split("-")[0]) if end_id else int(time.time() * 1000)
        tenant, conversation_id = unscoped(job.conversation_id)
        data = {
            "turn_id": job.turn_id,
            "conversation_id": conversation_id,
            "tenant": tenant,
            "stream_id": meta["stream"],
            "attempt": n,
            "status": status,
            "reason": record.get("reason"),
            "canonical_attempt": int(canonical) if canonical else None,
            "canonical_text_length": text_length,
            "last_offset": from_entry_id(end_id) if end_id else None,
        }
        body = {"type": EVENT_TYPE, "timestamp": iso_ms(ended_ms), "data": data}
        return orjson.dumps(body).decode(), self._target(tenant, meta["notify"]), ended_ms

    def _target(self, tenant: str | None, notify: str | None) -> str:
        """The turn's own URL (checked again when it is sent), else its tenant's; "" for
        none."""
        return notify or self._config.tenant_url(tenant) or ""

    async def _end_of(self, job: Job) -> str | None:
        """The entry id of the attempt's ``end`` event: the stream's last event when it ended
        (a later attempt's events may follow it), looked for from the stream's end."""
        key = self._keys.events(job.conversation_id, job.turn_id)
        top = "+"
        for _ in range(END_SCAN_PAGES):
            page = cast(
                rc.RawEntries,
                await self._redis.xrevrange(key, max=top, min="-", count=END_SCAN_PAGE),
            )
            for entry_id, raw in page:
                fields = rc.fields_dict(raw)
                if fields.get("e") != "end":
                    continue
                if orjson.loads(fields.get("d", "{}")).get("attempt") == job.attempt:
                    return str(entry_id)
            if len(page) < END_SCAN_PAGE:
                return None
            top = f"({page[-1][0]}"
        return None
