"""Compression: gzip for clients that ask, on event streams and JSON bodies.

An event stream flushes every write through its compressor, so a client that decodes as bytes
arrive sees each event as soon as it is written; a stream resumed with Last-Event-ID is the same
stream compressed. ``BROKER_COMPRESSION=off`` sends no ``Content-Encoding``, and a client that
does not ask (or refuses gzip by q-value) gets identity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Message

from broker.compression import CODING, GZIP, IDENTITY, GzipStream, negotiate
from broker.offsets import to_entry_id
from broker.settings import Settings, SettingsError
from broker.sse import PING, RAW_SEND, EventStreamResponse, Sink
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import read_sse, start_turn, text_of, wait_final

ASK_GZIP = {"Accept": "text/event-stream", "Accept-Encoding": "gzip"}


def gunzip() -> Any:
    return zlib.decompressobj(16 + zlib.MAX_WBITS)


# --- which coding a client asked for ----------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        (None, IDENTITY),
        ("", IDENTITY),
        ("gzip", GZIP),
        ("GZip", GZIP),
        ("x-gzip", GZIP),
        ("gzip, deflate, br, zstd", GZIP),
        ("br, zstd", IDENTITY),  # only what the broker does not offer
        ("deflate", IDENTITY),
        ("*", GZIP),
        ("*;q=0", IDENTITY),  # nothing is acceptable: identity, never a 406
        ("identity", IDENTITY),
        ("identity;q=0", IDENTITY),  # refuses identity but accepts nothing else
        ("gzip;q=0", IDENTITY),
        ("gzip;q=0, identity", IDENTITY),
        ("gzip, identity;q=0", GZIP),
        ("gzip;q=0.5, identity;q=0.8", IDENTITY),
        ("gzip;q=0.8, identity;q=0.5", GZIP),
        ("gzip;q=0.5, identity;q=0.5", GZIP),  # a tie compresses
        ("gzip;q=0.2", GZIP),  # identity was not named: any q above 0 is a yes
        ("*;q=0.5, identity;q=1", IDENTITY),
        ("identity;q=0, *;q=0.1", GZIP),
        ("gzip;q=nope", IDENTITY),  # a malformed q counts for nothing
        ("gzip;q=2", IDENTITY),
        ("gzip ; Q=0.7 , identity;q=0.6", GZIP),
    ],
)
def test_the_coding_follows_accept_encoding_and_its_q_values(
    header: str | None, coding: str
) -> None:
    assert negotiate(header) == coding


def test_every_write_of_a_gzip_stream_decodes_whole_at_once() -> None:
    stream, decoder = GzipStream(), gunzip()
    for piece in [b"retry: 1000\n\n", PING, b"id: 1\nevent: delta\ndata: {}\n\n" * 3, b""]:
        assert decoder.decompress(stream.write(piece)) == piece
    assert decoder.decompress(stream.finish(b"tail")) == b"tail"
    assert decoder.eof  # the member's trailer is there: a client knows the body is whole


# --- the event-stream response's own compressor -----------------------------------------------


class RecordingServer:
    """An ASGI server's side of one response: keeps the start and every body message."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.bodies: list[bytes] = []
        self.started = asyncio.Event()
        self.ended = asyncio.Event()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.headers = dict(message["headers"])
            self.started.set()
            return
        if message.get("body"):
            self.bodies.append(message["body"])
        if not message.get("more_body", False):
            self.ended.set()

    async def receive(self) -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError


@dataclasses.dataclass
class ScriptedSource:
    """A reader that yields what the test queues, and hands the response's sink out."""

    queue: asyncio.Queue[bytes | None] = dataclasses.field(default_factory=asyncio.Queue)
    sink: Sink | None = None
    waiting: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def __call__(self, sink: Sink) -> AsyncIterator[bytes]:
        self.sink = sink
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            self.waiting.set()
            chunk = await self.queue.get()
            self.waiting.clear()
            if chunk is None:
                return
            yield chunk


async def respond(coding: str | None) -> tuple[RecordingServer, ScriptedSource, asyncio.Task[None]]:
    server, source = RecordingServer(), ScriptedSource()
    response = EventStreamResponse(source, send_timeout_s=5)
    scope: dict[str, Any] = {"type": "http", RAW_SEND: server.send}
    if coding is not None:
        scope[CODING] = coding
    task = asyncio.create_task(response(scope, server.receive, server.send))
    await asyncio.wait_for(server.started.wait(), 5)
    await asyncio.wait_for(source.waiting.wait(), 5)
    return server, source, task


async def put_and_wait(source: ScriptedSource, server: RecordingServer, chunk: bytes) -> None:
    written = len(server.bodies)
    source.waiting.clear()
    await source.queue.put(chunk)
    await asyncio.wait_for(source.waiting.wait(), 5)  # asked for the next: this one is sent
    assert len(server.bodies) == written + 1


async def test_each_write_of_a_gzip_stream_decodes_to_that_write_alone() -> None:
    server, source, task = await respond(GZIP)
    assert server.headers[b"content-encoding"] == b"gzip"
    assert server.headers[b"vary"] == b"Accept-Encoding"
    assert source.sink is not None
    decoder = gunzip()
    frames = [b'id: %d\nevent: delta\ndata: {"text":"abcd"}\n\n' % n for n in range(4)]
    # The source's own writes and the live feed's direct ones share one compressor, in order.
    await put_and_wait(source, server, frames[0])
    assert source.sink.write_now(frames[1])
    await put_and_wait(source, server, frames[2])
    assert source.sink.write_now(frames[3])
    assert [decoder.decompress(body) for body in server.bodies] == frames
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)
    assert decoder.decompress(b"".join(server.bodies[4:])) == b""
    assert decoder.eof
    await asyncio.wait_for(task, 5)


async def test_a_heartbeat_through_the_compressor_costs_about_its_own_size() -> None:
    server, source, _task = await respond(GZIP)
    for _ in range(3):
        await put_and_wait(source, server, PING)
    decoder = gunzip()
    assert [decoder.decompress(body) for body in server.bodies] == [PING] * 3
    # The first carries the gzip header; after it a ping is a back-reference and a flush.
    assert all(len(body) <= len(PING) + 4 for body in server.bodies[1:])
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)


@pytest.mark.parametrize("coding", [IDENTITY, None])
async def test_a_stream_that_was_not_asked_for_gzip_is_sent_as_it_is(coding: str | None) -> None:
    server, source, _task = await respond(coding)
    assert b"content-encoding" not in server.headers
    # Vary only when the coding depended on the request, that is when compression is on.
    assert (b"vary" in server.headers) is (coding is not None)
    await put_and_wait(source, server, PING)
    assert server.bodies == [PING]
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)


# --- a real broker ----------------------------------------------------------------------------


@dataclasses.dataclass
class GzipRead:
    """What a gzip-asking client that decodes as bytes arrive saw."""

    headers: httpx.Headers
    events: list[tuple[str, str, dict[str, Any], float]]  # id, type, data, decoded at (wall)
    complete_member: bool  # the body ended with the gzip trailer


def read_gzip(
    broker: RunningBroker,
    stream_id: str,
    *,
    last_event_id: str | None = None,
    stop_after: int | None = None,
    accept_encoding: str = "gzip",
) -> GzipRead:
    headers = {**ASK_GZIP, "Accept-Encoding": accept_encoding}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    decoder, text = gunzip(), b""
    events: list[tuple[str, str, dict[str, Any], float]] = []
    url = f"{broker.base_url}/v1/streams/{stream_id}"
    with httpx.stream("GET", url, headers=headers, timeout=20) as response:
        assert response.status_code == 200
        for raw in response.iter_raw():  # the bytes as sent: httpx decodes nothing here
            text += decoder.decompress(raw)
            now = time.time()
            *frames, text = text.split(b"\n\n")
            for frame in frames:
                fields = dict(line.split(b": ", 1) for line in frame.split(b"\n") if b": " in line)
                # (A resume point's frame, where one is sent, names where the read starts.)
                if b"data" in fields and fields.get(b"event") != b"resume_point":
                    data = orjson.loads(fields[b"data"])
                    events.append((fields[b"id"].decode(), fields[b"event"].decode(), data, now))
            if stop_after is not None and len(events) >= stop_after:
                break
        return GzipRead(response.headers, events, decoder.eof)


def appended_at(offset: str) -> float:
    """When Redis appended the event of this offset (its entry id's milliseconds), in seconds."""
    return int(to_entry_id(offset).partition("-")[0]) / 1000


def delta_text(events: list[tuple[str, str, dict[str, Any], float]]) -> str:
    return "".join(str(data["text"]) for _, kind, data, _ in events if kind == "delta")


def test_a_live_gzip_stream_shows_each_event_before_the_next_is_written(
    broker: RunningBroker,
) -> None:
    turn = start_turn(broker.base_url, "gz-live", tokens=8, tokens_per_s=5)
    read = read_gzip(broker, turn["stream_id"])
    assert read.headers["content-encoding"] == "gzip"
    assert "accept-encoding" in read.headers["vary"].lower()
    assert read.complete_member
    kinds = [kind for _, kind, _, _ in read.events]
    assert kinds[0] == "attempt"
    assert kinds[-1] == "end"
    assert kinds.count("delta") == 8
    # Each live delta was decoded before the next one was even appended to Redis (200 ms
    # later): the compressor held nothing back, or every delta would wait for the next. Deltas
    # appended before the read's first bytes came as one replay, and a loaded machine may be
    # late for one delta; so: all live ones but one, of at least three. (An entry id's
    # milliseconds are truncated: 1 ms slack.)
    deltas = [event for event in read.events if event[1] == "delta"]
    first_bytes_at = read.events[0][3]
    live = [
        decoded_at < appended_at(next_id) + 0.001
        for (delta_id, _, _, decoded_at), (next_id, _, _, _) in itertools.pairwise(deltas)
        if appended_at(delta_id) > first_bytes_at
    ]
    assert len(live) >= 3, live
    assert live.count(False) <= 1, live
    plain = read_sse(broker.base_url, turn["stream_id"])
    assert delta_text(read.events) == text_of(plain.events)


def test_a_gzip_stream_resumed_with_last_event_id_has_no_gap_and_no_duplicate(
    broker: RunningBroker,
) -> None:
    turn = start_turn(broker.base_url, "gz-resume", tokens=20, tokens_per_s=40)
    first = read_gzip(broker, turn["stream_id"], stop_after=6)
    last_id = first.events[-1][0]
    rest = read_gzip(broker, turn["stream_id"], last_event_id=last_id)
    assert rest.headers["content-encoding"] == "gzip"
    ids = [event[0] for event in first.events + rest.events]
    assert len(ids) == len(set(ids))
    assert ids == sorted(ids)
    wait_final(broker.base_url, turn["turn_id"])
    whole = read_sse(broker.base_url, turn["stream_id"])
    assert delta_text(first.events + rest.events) == text_of(whole.events)
    assert rest.complete_member


def test_a_json_page_is_gzipped_for_a_client_that_asks(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "gz-page", tokens=30, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"])
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    params = {"format": "json", "offset": "-1"}
    with httpx.Client(timeout=10) as client:
        coded = client.get(url, params=params, headers={"Accept-Encoding": "gzip"})
        plain = client.get(url, params=params, headers={"Accept-Encoding": "identity"})
    assert coded.headers["content-encoding"] == "gzip"
    assert "accept-encoding" in coded.headers["vary"].lower()
    assert int(coded.headers["content-length"]) < len(plain.content) / 3
    assert "content-encoding" not in plain.headers
    assert "accept-encoding" in plain.headers["vary"].lower()  # the page varies either way
    assert coded.json() == plain.json()


def test_a_small_json_body_is_not_worth_compressing(broker: RunningBroker) -> None:
    response = httpx.get(
        f"{broker.base_url}/healthz", headers={"Accept-Encoding": "gzip"}, timeout=10
    )
    assert response.json() == {"status": "ok"}
    assert "content-encoding" not in response.headers


def test_a_client_that_does_not_ask_gets_identity(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "gz-none", tokens=30, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"])
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    with httpx.Client(timeout=10) as client:
        del client.headers["accept-encoding"]  # httpx asks for gzip by default
        page = client.get(url, params={"format": "json", "offset": "-1"})
        assert "accept-encoding" not in page.request.headers
        assert "content-encoding" not in page.headers
        assert page.json()["events"]
        with client.stream("GET", url) as stream:
            assert "content-encoding" not in stream.headers
            assert b"event: end" in b"".join(stream.iter_raw())
    refused = read_sse_headers(broker, url, "gzip;q=0, identity")
    assert "content-encoding" not in refused


def read_sse_headers(broker: RunningBroker, url: str, accept_encoding: str) -> httpx.Headers:
    headers = {**ASK_GZIP, "Accept-Encoding": accept_encoding}
    with httpx.stream("GET", url, headers=headers, timeout=10) as response:
        body = b"".join(response.iter_raw())
        assert b"event: end" in body  # as it is: identity
        return response.headers


def test_compression_off_sends_no_content_encoding(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(compression="off")
    turn = start_turn(broker.base_url, "gz-off", tokens=30, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"])
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    headers = read_sse_headers(broker, url, "gzip")
    assert "content-encoding" not in headers
    assert "vary" not in headers
    page = httpx.get(
        url, params={"format": "json", "offset": "-1"}, headers={"Accept-Encoding": "gzip"}
    )
    assert "content-encoding" not in page.headers
    assert page.json()["events"]


def test_the_setting_is_on_or_off() -> None:
    assert Settings().compression == "on"
    assert Settings.from_env({"BROKER_COMPRESSION": "off"}).compression == "off"
    with pytest.raises(SettingsError, match="BROKER_COMPRESSION must be on or off"):
        Settings.from_env({"BROKER_COMPRESSION": "gzip"})
