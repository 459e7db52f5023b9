"""The event-stream response's direct writes, against a scripted ASGI server.

A live feed writes to a waiting reader's response itself (``write_now``). These tests drive the
response with a ``send`` that can be made to wait, as a server's does when its client reads
slowly, and check that every chunk arrives once, in order, and that a write the client holds
up is let go after the send timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.types import Message

from broker.sse import RAW_SEND, EventStreamResponse, Sink


class ScriptedServer:
    """An ASGI server's side of one response: records body chunks; can hold writes up."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.disconnect = asyncio.Event()
        self.broken = False
        self.attempts = 0  # body sends begun, written or not
        self.progress = asyncio.Event()  # set at each send begun and each chunk written

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started.set()
            return
        self.attempts += 1
        self.progress.set()
        await self.writable.wait()  # as a server waits for its buffer to drain
        if self.broken:
            raise RuntimeError("the connection broke")
        if message.get("body"):
            self.chunks.append(message["body"])
            self.progress.set()
        if not message.get("more_body", False):
            self.ended.set()

    async def receive(self) -> Message:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


class Source:
    """A reader: yields what the test puts in, after handing the response's writer out."""

    def __init__(self) -> None:
        self.write_now: Callable[[bytes], bool] | None = None
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.waiting = asyncio.Event()
        self.closed = False

    def __call__(self, sink: Sink) -> AsyncIterator[bytes]:
        self.write_now = sink.write_now
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            while True:
                self.waiting.set()
                chunk = await self.queue.get()
                self.waiting.clear()
                if chunk is None:
                    return
                yield chunk
        finally:
            self.closed = True


async def start(
    source: Source, server: ScriptedServer, timeout_s: float = 5.0, batch_s: float = 0.0
) -> asyncio.Task[None]:
    response = EventStreamResponse(source, send_timeout_s=timeout_s, batch_s=batch_s)
    scope = {"type": "http", RAW_SEND: server.send}
    task = asyncio.create_task(response(scope, server.receive, server.send))
    await asyncio.wait_for(server.started.wait(), 5)
    await asyncio.wait_for(source.waiting.wait(), 5)
    return task


async def test_direct_writes_and_the_readers_own_arrive_once_in_order() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server)
    assert source.write_now is not None
    assert source.write_now(b"a")
    assert source.write_now(b"b")
    assert server.chunks == [b"a", b"b"]  # written at once, without a task switch
    await source.queue.put(b"c")
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)
    assert server.chunks == [b"a", b"b", b"c"]
    await asyncio.wait_for(task, 5)
    assert not source.write_now(b"late")  # the response is over


async def test_a_held_up_direct_write_finishes_before_the_next_chunk() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server)
    assert source.write_now is not None
    server.writable.clear()  # the client stops reading
    assert source.write_now(b"first")  # accepted: it will be written, by a task
    assert not source.write_now(b"second")  # one write at a time: the reader takes this one
    await source.queue.put(b"second")
    await asyncio.sleep(0.05)
    assert server.chunks == []
    server.writable.set()
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)
    assert server.chunks == [b"first", b"second"]
    await asyncio.wait_for(task, 5)


async def test_a_client_that_holds_up_a_direct_write_is_let_go() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server, timeout_s=0.2)
    assert source.write_now is not None
    server.writable.clear()
    assert source.write_now(b"stuck")
    # The watchdog ends the response; the source is closed and nothing more is written.
    await asyncio.wait_for(task, 5)
    assert server.chunks == []
    assert not source.write_now(b"after")


async def test_a_client_that_leaves_ends_the_response() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server)
    assert source.write_now is not None
    assert source.write_now(b"x")
    server.disconnect.set()
    await asyncio.wait_for(task, 5)
    assert not source.write_now(b"y")
    assert server.chunks == [b"x"]


async def test_a_held_up_direct_write_that_fails_ends_the_response_cleanly() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server)
    assert source.write_now is not None
    server.writable.clear()
    assert source.write_now(b"held")
    server.broken = True
    server.writable.set()  # the held-up write resumes, and fails
    await source.queue.put(b"next")  # whose send waits for it, and ends the response
    await asyncio.wait_for(task, 5)  # no exception escapes the response
    assert source.closed
    assert server.chunks == []


# --- batching (?batch_ms=) ------------------------------------------------------------------


async def wait_until_sent(server: ScriptedServer, condition: Callable[[], bool]) -> None:
    """Wait (5 s at most) until ``condition`` holds, looking again after each send."""

    async def holds() -> None:
        while not condition():
            server.progress.clear()
            await server.progress.wait()

    await asyncio.wait_for(holds(), 5)


async def wait_for_chunks(server: ScriptedServer, count: int) -> None:
    await wait_until_sent(server, lambda: len(server.chunks) >= count)


async def test_a_batching_response_sends_the_direct_writes_of_its_window_in_one() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server, batch_s=0.2)
    assert source.write_now is not None
    assert source.write_now(b"a")
    assert source.write_now(b"b")
    assert server.chunks == []  # held for the window, not written
    await wait_for_chunks(server, 1)
    assert server.chunks == [b"ab"]
    assert source.write_now(b"c")  # a new window starts with the next one
    await wait_for_chunks(server, 2)
    assert server.chunks == [b"ab", b"c"]
    await source.queue.put(None)
    await asyncio.wait_for(task, 5)


async def test_what_the_reader_yields_goes_at_once_after_what_was_held() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server, batch_s=30)  # a window that never closes in this test
    assert source.write_now is not None
    assert source.write_now(b"held-1")
    assert source.write_now(b"held-2")
    await source.queue.put(b"end")  # an `end` batch, a heartbeat: the reader's own chunk
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)
    assert b"".join(server.chunks) == b"held-1held-2end"
    await asyncio.wait_for(task, 5)


async def test_a_batching_response_refuses_writes_while_one_is_under_way() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server, batch_s=0.05)
    assert source.write_now is not None
    server.writable.clear()  # the client stops reading
    assert source.write_now(b"first")
    # The window closes: its write begins, and waits for the client.
    await wait_until_sent(server, lambda: server.attempts == 1)
    assert not source.write_now(b"second")  # the reader takes it (flow control, as unbatched)
    await source.queue.put(b"second")
    server.writable.set()
    await source.queue.put(None)
    await asyncio.wait_for(server.ended.wait(), 5)
    assert server.chunks == [b"first", b"second"]
    await asyncio.wait_for(task, 5)


async def test_a_batch_held_when_the_client_leaves_is_dropped_with_the_response() -> None:
    server, source = ScriptedServer(), Source()
    task = await start(source, server, batch_s=0.1)
    assert source.write_now is not None
    assert source.write_now(b"held")
    server.disconnect.set()
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.15)  # past the window: the cancelled flush writes nothing
    assert server.chunks == []
    assert not source.write_now(b"late")
