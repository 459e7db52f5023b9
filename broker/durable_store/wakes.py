"""The wake loop of Durable Streams subscriptions: it looks at due subscriptions and wakes them.

Every broker process that runs a worker runs one. It looks at the due set of every tenant
with subscriptions at once after an append of its own process to a tenant it knows has some,
and every 250 ms otherwise (another process's marks, leases that ended, backoffs that passed).
For a due subscription:

* ``webhook``: it takes the wake's lease (``ds_sub_claim``, holder ``webhook``) and POSTs the
  wake, signed with the broker's ed25519 key (``Webhook-Signature: t=..,kid=..,ed25519=..``),
  to the subscription's URL, resolved and checked again and connected to at the address that
  was checked. A 2xx answer ``{"done": true}`` acks every stream at the tail it was woken for
  and ends the wake; any other 2xx leaves the lease to the receiver, who calls back (ack,
  done) before it ends. A failed send ends the wake and looks again after a backoff (doubled
  per failure, capped, drawn from its upper half: ``BROKER_WEBHOOK_BACKOFF_MS``,
  ``BROKER_WEBHOOK_BACKOFF_MAX_MS``). A lease that ends without a callback is taken again with
  the next generation: a wake is never lost to a crash, only sent again.
* ``pull-wake``: it appends ``{"type": "wake", "subscription_id", "streams"}`` to the
  subscription's wake stream (once per wake, until a worker claims it), then records that it
  did; a crash between the two announces twice, never not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import random
import socket
import time
import urllib.parse
from typing import Any

import httpx
import orjson

from broker.durable_store.sub_model import url_refusal
from broker.durable_store.subscriptions import Subscriptions, Wake
from broker.errors import BrokerError, NotFound
from broker.settings import Settings
from broker.webhook_config import WebhookConfig

log = logging.getLogger("broker.durable_store.wakes")
USER_AGENT = "broker-durable-streams"


def jitter() -> float:
    """The part of a failed send's pause taken (its upper half: processes never retry in step,
    never at once)."""
    return random.uniform(0.5, 1.0)


def callback_url(base: str, sub_id: str, tenant: str | None) -> str:
    """Where a wake's holder acks: the subscription's ``callback``, with its tenant named (the
    callback is authorized by the wake's token alone)."""
    url = f"{base}/v1/stream/__ds/subscriptions/{urllib.parse.quote(sub_id, safe='')}/callback"
    return url if tenant is None else f"{url}?{urllib.parse.urlencode({'tenant': tenant})}"


def notification(wake: Wake, tenant: str | None) -> dict[str, Any]:
    return {
        "type": "wake",
        "subscription_id": wake.sub_id,
        "wake_id": wake.wake_id,
        "generation": wake.generation,
        "callback_url": callback_url(wake.base, wake.sub_id, tenant),
        "callback_token": wake.token,
        "lease_ttl_ms": wake.config.lease_ttl_ms,
        "streams": [s.json() for s in wake.streams],
    }


async def pinned(url: str, config: WebhookConfig, timeout_s: float) -> tuple[str, str, str | None]:
    """The URL to connect to (the host's checked address), the Host header and the TLS server
    name (None for http: the certificate is checked for the URL's host, not the address); raises
    ``BrokerError`` for a URL the rules refuse, ``OSError`` when it does not resolve."""
    refusal = url_refusal(config, url)
    if refusal is not None:
        raise BrokerError(refusal)
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    async with asyncio.timeout(timeout_s):
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(info[4][0]) for info in found]
    if not addresses:
        raise OSError(f"{host} has no address")
    for address in addresses:
        kind = config.address_refusal(address)
        if kind is not None:
            raise BrokerError(f"{config.address_message(host, kind)} (it resolved to {address})")
    tls_name = host if parts.scheme.lower() == "https" else None
    return str(httpx.URL(url).copy_with(host=str(addresses[0]))), parts.netloc, tls_name


class WakeLoop:
    """Looks at due subscriptions and wakes them (see the module's text)."""

    def __init__(
        self,
        subs: Subscriptions,
        config: WebhookConfig,
        http: httpx.AsyncClient,
        settings: Settings,
        poll_s: float = 0.25,
    ) -> None:
        self._subs = subs
        self._config = config
        self._http = http
        self._settings = settings
        self._poll_s = poll_s
        self._bell = asyncio.Event()
        self._stopped = False
        self._in_flight: dict[tuple[str | None, str], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="durable streams wakes")

    def nudge(self) -> None:
        """A subscription of this process's tenants is due now."""
        self._bell.set()

    async def stop(self) -> None:
        self._stopped = True
        self._bell.set()
        tasks = [t for t in (self._task, *self._in_flight.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self) -> None:
        while not self._stopped:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._bell.wait()
            self._bell.clear()
            if self._stopped:
                return
            try:
                await self.look()
            except Exception:
                log.exception("looking at due subscriptions failed")

    async def look(self) -> None:
        """Start a wake of every due subscription that none is in flight for."""
        now = self._subs.now_ms(int(time.time() * 1000))
        for item in await self._subs.due(now):
            if item not in self._in_flight:
                task = asyncio.create_task(self.handle(*item))
                self._in_flight[item] = task
                task.add_done_callback(functools.partial(self._landed, item))

    def _landed(self, item: tuple[str | None, str], _: object) -> None:
        self._in_flight.pop(item, None)

    async def handle(self, tenant: str | None, sub_id: str) -> None:
        try:
            try:
                sub = await self._subs.get(tenant, sub_id)
            except NotFound:  # deleted meanwhile
                await self._subs.forget(tenant, sub_id)
                return
            if sub.config.kind == "webhook":
                await self._deliver(tenant, sub_id)
            else:
                await self._announce(tenant, sub_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("waking subscription %r failed", sub_id)

    async def _announce(self, tenant: str | None, sub_id: str) -> None:
        sub = await self._subs.get(tenant, sub_id)
        pending = [s.path for s in sub.streams if s.has_pending]
        if pending and sub.holder is None and not await self._subs.announced(tenant, sub_id):
            event = {"type": "wake", "subscription_id": sub_id, "streams": pending}
            assert sub.config.wake_stream is not None
            await self._subs.wake_event(tenant, sub.config.wake_stream, orjson.dumps(event))
        await self._subs.start(tenant, sub_id, "announce", "")

    async def _deliver(self, tenant: str | None, sub_id: str) -> None:
        wake = await self._subs.start(tenant, sub_id, "deliver", "webhook")
        if not isinstance(wake, Wake):
            return
        assert wake.config.webhook_url is not None
        body = orjson.dumps(notification(wake, tenant))
        answer = await self._send(wake.config.webhook_url, body)
        if isinstance(answer, str):
            settings = self._settings
            retry = (settings.webhook_backoff_ms, settings.webhook_backoff_max_ms, jitter())
            pause = await self._end(tenant, wake, [], retry)
            log.warning("wake of subscription %r %s: again in %d ms", sub_id, answer, pause)
            return
        if answer.get("done") is True:
            acks = [(s.path, s.tail_offset) for s in wake.streams if s.has_pending]
            await self._end(tenant, wake, acks, None)

    async def _end(
        self,
        tenant: str | None,
        wake: Wake,
        acks: list[tuple[str, str]],
        retry: tuple[int, int, float] | None,
    ) -> int:
        """End a wake the loop holds (a later generation may have taken it: then nothing); the
        pause before the next send when ``retry``."""
        with contextlib.suppress(BrokerError):
            return (
                await self._subs.ack(
                    tenant,
                    wake.sub_id,
                    token=wake.token,
                    wake_id=wake.wake_id,
                    generation=wake.generation,
                    acks=acks,
                    done=True,
                    retry=retry,
                )
            )[1]
        return 0

    async def _send(self, url: str, body: bytes) -> dict[str, Any] | str:
        """POST a signed wake: the answer's JSON object ({} for none) on a 2xx, else why not."""
        timeout = self._settings.webhook_timeout_s
        try:
            target, host, tls_name = await pinned(url, self._config, timeout)
        except BrokerError as exc:
            return f"was refused ({exc.message})"
        except (OSError, TimeoutError, UnicodeError) as exc:
            return f"failed: cannot resolve its host ({type(exc).__name__})"
        signer = await self._subs.signer()
        headers = {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "host": host,
            "webhook-signature": signer.header(int(time.time()), body),
        }
        extensions = {} if tls_name is None else {"sni_hostname": tls_name}
        try:
            response = await self._http.post(
                target, content=body, headers=headers, timeout=timeout, extensions=extensions
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return f"failed: {type(exc).__name__}"
        if not 200 <= response.status_code < 300:
            return f"was answered {response.status_code}"
        try:
            answer = orjson.loads(response.content) if response.content else {}
        except orjson.JSONDecodeError:
            answer = {}
        return answer if isinstance(answer, dict) else {}
