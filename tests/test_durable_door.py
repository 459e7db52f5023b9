"""The Durable Streams routes' own door answers as the framework's routes do: one table of
requests, each sent through the broker's server (the front door sends it to ``DurableDoor``,
which answers it at once or through the app's layers) and to the FastAPI app itself (its
routes), with the same status, body and headers: the caller's checks, the limits, CORS,
compression, the security headers and the error shape."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from broker.api.stream_reads import FrontDoor
from broker.dialects.durable.door import DurableDoor
from tests.conftest import BrokerFactory, RunningBroker

pytestmark = pytest.mark.server

KEY = "key-acme-0123456789abcdef"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = {**AUTH, "Content-Type": "text/plain"}
# Headers a server adds on its own, not the app's.
OWN = frozenset({"date", "server", "connection", "keep-alive", "transfer-encoding"})
BIG = b"x" * 3000
PART = b"y" * 900


def _framework(broker: RunningBroker) -> FastAPI:
    app: Any = broker.server.config.loaded_app
    while not isinstance(app, FrontDoor):
        app = app.app
    framework = app.app
    assert isinstance(framework, FastAPI)
    assert [type(door) for door in app.doors] == [DurableDoor]  # what the server answers with
    return framework


async def _in_app(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    if "chunks" in kwargs:  # a body of unknown length (sent chunked)
        chunks = kwargs.pop("chunks")

        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        kwargs["content"] = body()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.request(method, path, **kwargs)


def _answer(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    headers = {k: v for k, v in response.headers.items() if k not in OWN}
    body = response.content
    if headers.get("content-encoding") == "gzip" and body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)  # (httpx decodes it already for most)
    return response.status_code, headers, body


@pytest.fixture(params=["cors", "no cors"])
def broker(broker_factory: BrokerFactory, request: pytest.FixtureRequest) -> RunningBroker:
    """A secured broker with small limits, with CORS (every answer through the app's layers)
    or without (a plain request answered at once, the others through the layers)."""
    running = broker_factory(
        api_keys=f"acme={KEY}",
        cors_origins=ORIGIN if request.param == "cors" else None,
        max_body_bytes=1024,
        max_header_bytes=4096,
    )
    for path, body in (("d/text", b"hello"), ("d/big", b""), ("d/closed", b"done")):
        made = httpx.put(f"{running.base_url}/ds/v1/stream/{path}", headers=TEXT, content=body)
        assert made.status_code == 201, made.text
    for _ in range(4):  # a body worth compressing, each append under the limit
        url = f"{running.base_url}/ds/v1/stream/d/big"
        assert httpx.post(url, headers=TEXT, content=PART).status_code == 204
    closed = httpx.post(
        f"{running.base_url}/ds/v1/stream/d/closed",
        headers={**AUTH, "Stream-Closed": "true"},
    )
    assert closed.status_code == 204
    return running


CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("no credentials", "GET", "/ds/v1/stream/d/text?offset=-1", {}),
    ("a bad key", "POST", "/ds/v1/stream/d/text", {"headers": {"Authorization": "Bearer x"}}),
    ("a catch-up read", "GET", "/ds/v1/stream/d/text?offset=-1", {"headers": AUTH}),
    (
        "a catch-up read, gzip",
        "GET",
        "/ds/v1/stream/d/big?offset=-1",
        {"headers": {**AUTH, "Accept-Encoding": "gzip"}},
    ),
    (
        "a read from a CORS page",
        "GET",
        "/ds/v1/stream/d/text",
        {"headers": {**AUTH, "Origin": ORIGIN}},
    ),
    ("metadata", "HEAD", "/ds/v1/stream/d/text", {"headers": AUTH}),
    ("a missing stream", "GET", "/ds/v1/stream/d/none", {"headers": AUTH}),
    ("a bad live", "GET", "/ds/v1/stream/d/text?live=nope", {"headers": AUTH}),
    ("no stream path", "GET", "/ds/v1/stream/", {"headers": AUTH}),
    (
        "an append to a closed stream",
        "POST",
        "/ds/v1/stream/d/closed",
        {"headers": TEXT, "content": b"more"},
    ),
    (
        "a close again",
        "POST",
        "/ds/v1/stream/d/closed",
        {"headers": {**AUTH, "Stream-Closed": "true"}},
    ),
    ("a body past the limit", "POST", "/ds/v1/stream/d/text", {"headers": TEXT, "content": BIG}),
    (
        "headers past the limit",
        "GET",
        "/ds/v1/stream/d/text",
        {"headers": {**AUTH, "X-Big": "y" * 5000}},
    ),
    (
        "a write to a generation",
        "POST",
        "/ds/v1/stream/st_0123456789abcdef01234567",
        {"headers": TEXT, "content": b"x"},
    ),
    ("a method the protocol lacks", "PATCH", "/ds/v1/stream/d/text", {"headers": AUTH}),
    ("a delete of a missing stream", "DELETE", "/ds/v1/stream/d/none", {"headers": AUTH}),
    (
        "a chunked append to a closed stream",  # (no Content-Length: through the layers)
        "POST",
        "/ds/v1/stream/d/closed",
        {"headers": TEXT, "chunks": [b"mo", b"re"]},
    ),
    (
        "a chunked body past the limit",
        "POST",
        "/ds/v1/stream/d/text",
        {"headers": TEXT, "chunks": [BIG[:900], BIG[900:]]},
    ),
    (
        "a CORS preflight",
        "OPTIONS",
        "/ds/v1/stream/d/text",
        {"headers": {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}},
    ),
]


@pytest.mark.parametrize(("case", "method", "path", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_the_door_answers_as_the_framework_routes_do(
    broker: RunningBroker, case: str, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    sent = dict(kwargs)
    if "chunks" in sent:
        sent["content"] = iter(sent.pop("chunks"))
    door = httpx.request(method, f"{broker.base_url}{path}", timeout=10, **sent)
    framework = broker.call(_in_app(_framework(broker), method, path, **kwargs))
    assert _answer(door) == _answer(framework), case
    if door.status_code >= 400:
        assert set(door.json()["error"]) == {"code", "message"}
    cors = broker.settings.cors_origins is not None
    if method == "OPTIONS" and cors:  # (the CORS layer answers it, outside the others)
        assert door.headers["access-control-allow-origin"] == ORIGIN
        return
    assert door.headers["x-content-type-options"] == "nosniff"
    assert door.headers["cross-origin-resource-policy"] == "cross-origin"
    from_page = cors and "Origin" in kwargs.get("headers", {})
    assert ("access-control-allow-origin" in door.headers) == from_page
    assert door.headers.get("content-encoding") == ("gzip" if "gzip" in case else None)
