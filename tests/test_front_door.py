"""The front door's dispatch, as a table: which requests the stream reads' own app answers, and
which go on to FastAPI (issue 36: one door serves the SSE read)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from broker.api.stream_reads import FrontDoor, StreamReads
from broker.dialects.durable.door import DurableDoor


def scope(method: str, path: str, query: bytes = b"", root: str = "") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root,
        "query_string": query,
        "headers": [],
    }


@pytest.mark.parametrize(
    ("request_scope", "door"),
    [
        (scope("GET", "/v1/streams/st_1"), "reads"),
        (scope("GET", "/v1/streams/st_1", b"offset=-1&heartbeat=30"), "reads"),
        (scope("GET", "/v1/streams/st_1", b"format=json&offset=-1"), "app"),
        (scope("GET", "/v1/streams/st_1", b"%66ormat=json"), "app"),  # as the route reads it
        (scope("GET", "/v1/streams/st_1", b"format=sse"), "reads"),
        (scope("GET", "/v1/streams/st_1", b"format=xml"), "reads"),  # (its 400 is the read's)
        (scope("POST", "/v1/streams/st_1"), "app"),
        (scope("HEAD", "/v1/streams/st_1"), "app"),
        (scope("GET", "/v1/streams/"), "app"),
        (scope("GET", "/v1/streams/st_1/more"), "app"),
        (scope("GET", "/v1/turns/t_1"), "app"),
        (scope("GET", "/broker/v1/streams/st_1", root="/broker"), "reads"),
        ({"type": "lifespan"}, "app"),
    ],
)
async def test_the_front_door_sends_sse_reads_to_their_own_app_and_the_rest_on(
    request_scope: dict[str, Any], door: str
) -> None:
    assert await dispatched(request_scope) == [door]


async def dispatched(request_scope: dict[str, Any], *, durable: bool = False) -> list[str]:
    """Which of the front door's apps took ``request_scope`` (``durable``: with a door that
    claims the Durable Streams routes beside the SSE reads' one)."""
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append("app")

    class Reads(StreamReads):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            seen.append("reads")

    reads = Reads(
        lambda: None,  # type: ignore[arg-type,return-value]
        max_header_bytes=16_384,
        compression=False,
        cors=False,
        layered=lambda read: read,
    )

    async def receive() -> Any:
        raise AssertionError("nothing is read")

    async def send(message: Any) -> None:
        raise AssertionError("nothing is sent")

    doors = [Claims(seen)] if durable else []
    await FrontDoor(app, reads, doors)(request_scope, receive, send)
    return seen


class Claims:
    """A door that claims the Durable Streams routes, as ``DurableDoor.path`` reads them."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def claims(self, scope: Scope) -> bool:
        return DurableDoor.path(scope) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append("durable")


@pytest.mark.parametrize(
    ("request_scope", "door", "path"),
    [
        (scope("POST", "/ds/v1/stream/a/b"), "durable", "a/b"),
        (scope("PUT", "/ds/v1/stream/a"), "durable", "a"),
        (scope("GET", "/ds/v1/stream/a", b"offset=-1&live=sse"), "durable", "a"),
        (scope("HEAD", "/ds/v1/stream/a"), "durable", "a"),
        (scope("DELETE", "/ds/v1/stream/a"), "durable", "a"),
        (scope("GET", "/ds/v1/stream/"), "durable", ""),  # (its 404 is the route's)
        (scope("OPTIONS", "/ds/v1/stream/a"), "app", None),  # a preflight: the CORS layer's
        (scope("PATCH", "/ds/v1/stream/a"), "app", None),  # the framework's 405
        (scope("GET", "/ds/v1/stream"), "app", None),
        (scope("GET", "/ds/v1/streams/a"), "app", None),
        # The reserved paths are the subscription routes', in the framework.
        (scope("PUT", "/ds/v1/stream/__ds/subscriptions/s1"), "app", None),
        (scope("GET", "/ds/v1/stream/__ds/jwks.json"), "app", None),
        (scope("GET", "/ds/v1/stream/__ds"), "app", None),
        (scope("GET", "/ds/v1/stream/__dsx"), "durable", "__dsx"),
        (scope("POST", "/broker/ds/v1/stream/a", root="/broker"), "durable", "a"),
        (scope("GET", "/v1/streams/st_1"), "reads", None),  # the SSE reads' door comes first
        ({"type": "lifespan"}, "app", None),
    ],
)
async def test_the_front_door_sends_the_durable_streams_routes_to_their_door(
    request_scope: dict[str, Any], door: str, path: str | None
) -> None:
    assert await dispatched(request_scope, durable=True) == [door]
    assert (DurableDoor.path(request_scope) if request_scope["type"] == "http" else None) == path
