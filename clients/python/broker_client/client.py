"""Async HTTP client for the broker: start turns, read them, and follow their event streams."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx

from .errors import (
    BrokerConnectionError,
    BrokerHTTPError,
    Conflict,
    NotFound,
    ProtocolError,
    ReattachExhausted,
    ResponseEnded,
    StreamNotFound,
    TurnNotFound,
    error_from_response,
    parse_retry_after,
)
from .models import ApprovalDecision, AttachToken, Event, Page, Turn
from .sse import SSEDecoder

__all__ = [
    "AttachPolicy",
    "AttachStats",
    "BrokerClient",
    "ReconnectInfo",
    "backoff_delay",
]

# Statuses that describe a passing condition (broker restarting, Redis down, overload) rather than
# a wrong request, so `attach` waits and tries again. 401 and 403 are never among them: refused
# credentials do not get better by asking again.
_RETRYABLE_STATUSES = frozenset({408, 425, 429})

# The event whose id is where a read from `now` starts (its data repeats it as `offset`).
RESUME_POINT = "resume_point"


@dataclass(frozen=True, slots=True)
class AttachPolicy:
    """How `BrokerClient.attach` reconnects.

    `max_retries` bounds consecutive failed connections; a connection that delivers at least one
    new event or heartbeat resets the count. `max_reconnect_time`, if set, also bounds the seconds
    spent in one such run of failures. Before the n-th consecutive retry `attach` sleeps
    uniform(0, min(max_delay, base * 2**(n-1))) (full jitter), where base is the server's `retry:`
    field when it sent one, else `base_delay`. A `Retry-After` answer (429, 503) makes the wait
    at least that long, and a 429 without one waits at least the base; a `Retry-After` beyond
    `max_retry_after` seconds ends `attach` with that error instead. `read_timeout` must exceed
    the server's heartbeat interval (15 s) so that only dead connections time out.
    """

    max_retries: int = 8
    base_delay: float = 0.5
    max_delay: float = 15.0
    max_reconnect_time: float | None = None
    read_timeout: float = 45.0
    connect_timeout: float = 10.0
    max_retry_after: float = 60.0


@dataclass(slots=True)
class AttachStats:
    """Counters that `attach` updates in place; pass one in to watch a stream's health."""

    reconnects: int = 0
    failures: int = 0
    events: int = 0
    duplicates: int = 0
    heartbeats: int = 0
    last_event_id: str | None = None
    last_error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class ReconnectInfo:
    """What `attach` passes to `on_reconnect` just before it sleeps and reconnects."""

    failures: int
    delay: float
    error: BaseException
    last_event_id: str | None


def backoff_delay(
    failures: int, base: float, cap: float, rand: Callable[[], float] = random.random
) -> float:
    """Full-jitter delay before the reconnect that follows the `failures`-th consecutive failure."""
    # Clamp the exponent: past ~60 doublings any sane cap has long been reached, and a huge power
    # of two would overflow the float multiplication.
    exponent = min(max(failures - 1, 0), 60)
    return rand() * min(cap, base * 2.0**exponent)


class _Retry(Exception):
    """Internal: carries a retryable HTTP error, and the least wait before retrying, out of the
    response context."""

    def __init__(self, error: BrokerHTTPError, wait: float) -> None:
        super().__init__(str(error))
        self.error = error
        self.wait = wait


class _ChunkReader:
    """Reads a response body chunk by chunk, giving up early when `stop` is set.

    Without `stop` it awaits the body directly; with it, each read races `stop.wait()`, since a
    quiet stream may otherwise block for a whole read timeout before the caller's stop is noticed.
    """

    def __init__(self, response: httpx.Response, stop: asyncio.Event | None) -> None:
        self._chunks = response.aiter_bytes()
        self._stop = stop
        self._stop_task: asyncio.Task[bool] | None = None
        self._inflight: asyncio.Future[bytes | None] | None = None
        self.stopped = False

    async def next(self) -> bytes | None:
        """Return the next chunk, or None at the end of the body or once stopped."""
        if self._stop is None:
            return await _next_or_none(self._chunks)
        if self._stop.is_set():
            self.stopped = True
            return None
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop.wait())
        read = self._inflight = asyncio.ensure_future(_next_or_none(self._chunks))
        try:
            await asyncio.wait({read, self._stop_task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            read.cancel()
            raise
        if read.done():
            self._inflight = None
            return read.result()
        read.cancel()
        # asyncio.wait does not raise the read's CancelledError, only our own cancellation.
        await asyncio.wait({read})
        self._inflight = None
        self.stopped = True
        return None

    async def aclose(self) -> None:
        """Release the stop watcher and the body iterator."""
        if self._stop_task is not None:
            self._stop_task.cancel()
            await asyncio.wait({self._stop_task})
        aclose = getattr(self._chunks, "aclose", None)
        # An iterator still running in a cancelled read cannot be closed from here; closing the
        # response (done by the caller) releases the connection either way.
        if aclose is not None and (self._inflight is None or self._inflight.done()):
            await aclose()


async def _next_or_none(chunks: AsyncIterator[bytes]) -> bytes | None:
    # StopAsyncIteration must not escape a task, so the end of the body becomes None.
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _sleep_or_stop(delay: float, stop: asyncio.Event | None) -> bool:
    """Sleep for `delay` seconds; return True early if `stop` gets set."""
    if stop is None:
        await asyncio.sleep(delay)
        return False
    try:
        async with asyncio.timeout(delay):
            await stop.wait()
    except TimeoutError:
        return False
    return True


def _is_retryable_status(status: int) -> bool:
    return status >= 500 or status in _RETRYABLE_STATUSES


def _reattach_may_retry(error: BrokerHTTPError, connected: bool) -> bool:
    """Whether `attach` waits and reconnects after this answer instead of raising it."""
    if _is_retryable_status(error.status):
        return True
    # A one-viewer token's lock outlives a cut connection by a moment: the broker releases it
    # once it notices the disconnect. Our own earlier connection is then the viewer in the way.
    return connected and isinstance(error, Conflict) and error.code == "token_in_use"


def _least_wait(response: httpx.Response, base: float) -> float:
    """How long to stay away at least: `Retry-After`, else the base for a 429 or a 409 (whose
    waits should not be shortened to nothing by the jitter), else nothing."""
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if retry_after is not None:
        return retry_after
    return base if response.status_code in (409, 429) else 0.0


class _Cursor:
    """Where `attach` stands in a stream, carried from one connection to the next."""

    def __init__(self, stats: AttachStats) -> None:
        self.stats = stats
        self.last_id: str | None = None
        self.last_type: str | None = None
        self.retry_base: float | None = None
        self.progressed = False
        self.stopped = False

    async def read(
        self, response: httpx.Response, stop: asyncio.Event | None
    ) -> AsyncGenerator[Event, None]:
        """Yield the new events of one response, advancing the cursor as they pass.

        Sets `progressed` (the caller clears it before each connection) when the response delivers
        a new event or a heartbeat: either proves the broker is up and serving this stream, so a
        quiet turn on a connection that keeps getting cut does not count as an outage.
        """
        decoder = SSEDecoder()
        reader = _ChunkReader(response, stop)
        try:
            while (chunk := await reader.next()) is not None:
                for sse in decoder.feed(chunk):
                    if sse.event == "replaced":
                        # A newer connection of our one-viewer token took over: reconnecting
                        # would only take it back.
                        reason = Event.from_parts(sse.id, sse.event, sse.data).data
                        raise Conflict(
                            409,
                            str(reason.get("code", "viewer_replaced")),
                            str(reason.get("message", "a newer viewer took over")),
                            reason,
                        )
                    event = Event.from_parts(sse.id, sse.event, sse.data)
                    if event.type == RESUME_POINT:
                        # Where a read from `now` starts: the resume point, not an event.
                        if self.last_id is None or event.id > self.last_id:
                            self._advance(event.id)
                        continue
                    if self.last_id is not None and event.id <= self.last_id:
                        # Safety net: a replay overlapping what was already yielded.
                        self.stats.duplicates += 1
                        continue
                    self._advance(event.id)
                    self.last_type = event.type
                    self.stats.events += 1
                    yield event
                # A block with an id but no data (older brokers' resume point) moves the resume
                # point without an event.
                if decoder.last_event_id and (
                    self.last_id is None or decoder.last_event_id > self.last_id
                ):
                    self._advance(decoder.last_event_id)
                if decoder.retry is not None:
                    self.retry_base = decoder.retry / 1000.0
                if decoder.comments:
                    self.stats.heartbeats += decoder.comments
                    decoder.comments = 0
                    self._mark_progress()
        finally:
            await reader.aclose()
        self.stopped = reader.stopped

    def _advance(self, event_id: str) -> None:
        self.last_id = self.stats.last_event_id = event_id
        self._mark_progress()

    def _mark_progress(self) -> None:
        self.progressed = True
        self.stats.failures = 0


class BrokerClient:
    """Client for one broker, usable as an async context manager.

    `api_key` is sent as `Authorization: Bearer <api_key>` on every call: an API key, a JWT, or
    an attach token (which can only read its stream). Pass `http` to share an `httpx.AsyncClient`
    (connection pool, transport, auth); the caller then owns it and `aclose` leaves it open.
    `timeout` applies to the one-shot requests; stream reads use the policy's `read_timeout`.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        http: httpx.AsyncClient | None = None,
        policy: AttachPolicy | None = None,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.policy = policy if policy is not None else AttachPolicy()
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._auth: dict[str, str] = {}
        if api_key is not None:
            if not api_key.strip() or any(c in api_key for c in "\r\n"):
                raise ValueError("api_key must be a non-empty single-line string")
            if any(name.lower() == "authorization" for name in self._headers):
                raise ValueError("pass the credential as api_key or as a header, not both")
            self._auth = {"Authorization": f"Bearer {api_key.strip()}"}
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient(timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()

    async def start_turn(
        self,
        conversation_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        turn_id: str | None = None,
        provider: str | None = None,
        model: str | None = None,
        params: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        response_format: str | Mapping[str, Any] | None = None,
        client_tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Turn:
        """Start a generation turn (POST /v1/turns); only arguments that are not None are sent.

        `response_format` is `"text"`, `"json"` or the JSON Schema form (`{"type":
        "json_schema", "name", "schema", ...}`). With a `turn_id` the call is idempotent: the
        broker answers 200 with the existing turn and `Turn.created` is False. `client_tools`
        are tools the client runs: their calls end the turn `requires_action` (see the broker's
        docs/tools.md). Raises `Conflict` on 409 and the matching `BrokerHTTPError` on other
        error statuses.
        """
        optional: dict[str, Any] = {
            "turn_id": turn_id,
            "provider": provider,
            "model": model,
            "params": dict(params) if params is not None else None,
            "tools": [dict(t) for t in tools] if tools is not None else None,
            "client_tools": [dict(t) for t in client_tools] if client_tools is not None else None,
            "response_format": (
                dict(response_format) if isinstance(response_format, Mapping) else response_format
            ),
        }
        body: dict[str, Any] = {
            "conversation_id": conversation_id,
            "messages": [dict(m) for m in messages],
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        response = await self._request("POST", "/v1/turns", json=body)
        return Turn.from_json(
            _json_body(response),
            created=response.status_code == 201,
            conversation_id=conversation_id,
        )

    async def get_turn(self, turn_id: str) -> dict[str, Any]:
        """Fetch a turn's current state (GET /v1/turns/{turn_id}); raises `TurnNotFound` on 404."""
        response = await self._request(
            "GET", f"/v1/turns/{quote(turn_id, safe='')}", not_found=TurnNotFound
        )
        raw = _json_body(response)
        if not isinstance(raw, dict):
            raise ProtocolError(f"turn answer is not a JSON object: {raw!r}")
        return raw

    async def approve(
        self, turn_id: str, approval_id: str, *, token: str | None = None
    ) -> ApprovalDecision:
        """Approve a tool call that waits for a person; see `decide`."""
        return await self.decide(turn_id, approval_id, "approve", token=token)

    async def deny(
        self, turn_id: str, approval_id: str, reason: str | None = None, *, token: str | None = None
    ) -> ApprovalDecision:
        """Deny a tool call that waits for a person (the model is told `reason`); see `decide`."""
        return await self.decide(turn_id, approval_id, "deny", reason, token=token)

    async def decide(
        self,
        turn_id: str,
        approval_id: str,
        decision: str,
        reason: str | None = None,
        *,
        token: str | None = None,
    ) -> ApprovalDecision:
        """POST /v1/turns/{turn_id}/approvals/{approval_id}: the first decision wins, and the
        one that stands is returned (compare its `decision` with yours: another device, or the
        expiry, may have decided first). `token`: an attach token minted with `approve=True`."""
        body: dict[str, Any] = {"decision": decision}
        if reason is not None:
            body["reason"] = reason
        path = f"/v1/turns/{quote(turn_id, safe='')}/approvals/{quote(approval_id, safe='')}"
        try:
            params = {"token": token} if token is not None else None
            response = await self._request("POST", path, json=body, params=params, token=token)
        except Conflict as exc:  # another decision stands: it is in the body
            if isinstance(exc.body, dict) and "decision" in exc.body:
                return ApprovalDecision.from_data(exc.body)
            raise
        return ApprovalDecision.from_data(_json_body(response))

    async def mint_attach_token(
        self,
        turn_id: str,
        ttl_s: float | None = None,
        one_viewer: bool = False,
        approve: bool = False,
    ) -> AttachToken:
        """Mint a read-only token for a turn's stream (POST /v1/turns/{turn_id}/attach-tokens).

        `ttl_s` defaults to the broker's `BROKER_ATTACH_TOKEN_TTL` and is capped at its
        `BROKER_ATTACH_TOKEN_MAX_TTL`; with `one_viewer` the token admits one SSE connection at a
        time. Raises `TurnNotFound` on 404 and `Forbidden` (`read_only`) for an attach token.
        """
        body: dict[str, Any] = {"one_viewer": one_viewer}
        if approve:  # the approve scope: the token may also decide the turn's approvals
            body["approve"] = True
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        response = await self._request(
            "POST",
            f"/v1/turns/{quote(turn_id, safe='')}/attach-tokens",
            json=body,
            not_found=TurnNotFound,
        )
        return AttachToken.from_json(_json_body(response), base_url=self.base_url, turn_id=turn_id)

    async def catch_up(
        self, stream_id: str, offset: str = "-1", *, token: str | None = None
    ) -> Page:
        """Fetch the events after `offset` as one JSON page, for clients that poll.

        `token` (an attach token) is sent as `?token=` instead of the client's credential.
        """
        params = {"format": "json", "offset": offset}
        if token is not None:
            params["token"] = token
        response = await self._request(
            "GET", _stream_path(stream_id), params=params, not_found=StreamNotFound, token=token
        )
        return Page.from_json(_json_body(response))

    def _attach_request(
        self, offset: str, token: str | None, last_id: str | None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """The headers and query of one (re)connection of :meth:`attach`."""
        headers = {**self._headers, **self._credential(token), "Accept": "text/event-stream"}
        params = {"offset": offset}
        if token is not None:
            params["token"] = token
        if last_id is not None:
            # The broker prefers Last-Event-ID; the offset says the same for any proxy or
            # server version that only reads the query string.
            params["offset"] = headers["Last-Event-ID"] = last_id
        return headers, params

    async def attach(
        self,
        stream_id: str,
        *,
        offset: str = "-1",
        token: str | None = None,
        policy: AttachPolicy | None = None,
        stop: asyncio.Event | None = None,
        stats: AttachStats | None = None,
        on_reconnect: Callable[[ReconnectInfo], None] | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Follow a stream over SSE from `offset` until the turn is at rest, reconnecting as needed.

        The generator returns when a response closes cleanly and the last event received was
        `end` (the broker closes the response once the turn is at rest), when the broker answers
        204 (the turn is at rest and nothing follows the resume point), or when `stop` is set.
        Any other way a response finishes (transport or read error, read timeout, a close without
        a final `end`, a 5xx/408/429 answer, an unreachable broker) leads to a reconnect from the
        last event id after a jittered backoff, never shorter than a `Retry-After`; too many
        consecutive failures raise `ReattachExhausted`. 400, 401, 403, 404 and 410 raise
        `BadRequest`, `Unauthorized`, `Forbidden`, `StreamNotFound` and `StreamExpired` at once;
        A one-viewer token's newest connection takes the token over; the connection it took it
        from gets a `replaced` event, on which this raises `Conflict` (`viewer_replaced`)
        instead of reconnecting. (Brokers before that answered a second connection 409
        `token_in_use`, which raises `Conflict` on the first connection and is waited out on a
        reconnect.) Events are yielded once each, in id order.

        `token` (an attach token) is sent as `?token=` instead of the client's credential.
        """
        policy = policy if policy is not None else self.policy
        stats = stats if stats is not None else AttachStats()
        cursor = _Cursor(stats)
        url = self._url(_stream_path(stream_id))
        timeout = httpx.Timeout(
            self._timeout, connect=policy.connect_timeout, read=policy.read_timeout
        )
        loop = asyncio.get_running_loop()
        streak_started: float | None = None
        connected = False

        while True:
            if stop is not None and stop.is_set():
                return
            cursor.progressed = False
            headers, params = self._attach_request(offset, token, cursor.last_id)
            failure: BaseException
            least_wait = 0.0
            try:
                async with self._http.stream(
                    "GET", url, params=params, headers=headers, timeout=timeout
                ) as response:
                    if response.status_code == 204:
                        return  # the turn is at rest and nothing follows our position
                    if response.status_code != 200:
                        error = error_from_response(
                            response.status_code,
                            await response.aread(),
                            not_found=StreamNotFound,
                            headers=response.headers,
                        )
                        if _reattach_may_retry(error, connected):
                            base = max(cursor.retry_base or 0.0, policy.base_delay)
                            raise _Retry(error, _least_wait(response, base))
                        raise error
                    connected = True
                    _check_event_stream(response)
                    async with contextlib.aclosing(cursor.read(response, stop)) as events:
                        async for event in events:
                            yield event
                            if stop is not None and stop.is_set():
                                return
                    if cursor.stopped:
                        return
                if cursor.last_type == "end":
                    return
                failure = ResponseEnded(f"stream {stream_id!r} response ended before the turn did")
            except _Retry as retry:
                failure = retry.error
                least_wait = retry.wait
                if least_wait > policy.max_retry_after:
                    raise retry.error from None
            except httpx.UnsupportedProtocol:
                # A bad URL scheme will not fix itself.
                raise
            except httpx.TransportError as exc:
                failure = exc

            if cursor.progressed:
                streak_started = None
            stats.failures += 1
            stats.last_error = failure
            now = loop.time()
            if streak_started is None:
                streak_started = now
            if stats.failures > policy.max_retries or (
                policy.max_reconnect_time is not None
                and now - streak_started >= policy.max_reconnect_time
            ):
                raise ReattachExhausted(stats.failures, failure) from failure
            base = cursor.retry_base if cursor.retry_base is not None else policy.base_delay
            delay = max(backoff_delay(stats.failures, base, policy.max_delay), least_wait)
            stats.reconnects += 1
            if on_reconnect is not None:
                on_reconnect(ReconnectInfo(stats.failures, delay, failure, cursor.last_id))
            if await _sleep_or_stop(delay, stop):
                return

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _credential(self, token: str | None) -> dict[str, str]:
        # A read with an attach token sends the token alone: the broker prefers it anyway, and
        # the API key has no business travelling along with a link someone may share.
        return {} if token is not None else self._auth

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        not_found: type[NotFound] = NotFound,
        token: str | None = None,
    ) -> httpx.Response:
        headers = {**self._headers, **self._credential(token), "Accept": "application/json"}
        try:
            response = await self._http.request(
                method,
                self._url(path),
                json=json,
                params=params,
                headers=headers,
                timeout=self._timeout,
            )
        except httpx.TransportError as exc:
            # The path holds no query string, so the message never shows a `?token=`.
            raise BrokerConnectionError(f"{method} {path}: {exc!r}") from exc
        if response.status_code >= 400:
            raise error_from_response(
                response.status_code,
                response.content,
                not_found=not_found,
                headers=response.headers,
            )
        return response


def _stream_path(stream_id: str) -> str:
    return f"/v1/streams/{quote(stream_id, safe='')}"


def _json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ProtocolError(
            f"expected JSON from {response.request.url}, got {response.text[:200]!r}"
        ) from exc


def _check_event_stream(response: httpx.Response) -> None:
    content_type = response.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "text/event-stream":
        raise ProtocolError(f"expected text/event-stream, got {content_type!r}")
