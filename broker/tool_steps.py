"""The tool calls of one attempt: assembled from the model's chunks, dispatched through the
ledger as soon as each is whole, and shown on the stream as a ``tool_call`` and its
``tool_result``.

A call is named by its tool and its ordinal (the how-many-th call of that tool in the attempt,
counted across its steps and upstream calls): that is the ledger slot which makes a call that is
run again (a retry, a takeover) find its stored outcome instead of running twice.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

from broker.errors import StopRequested, StreamFull
from broker.lease import TurnWriter
from broker.ledger import Dispatcher, Outcome, Slot
from broker.metrics import Metrics
from broker.output import AttemptOutput
from broker.providers import ToolCallChunk


class ToolFailure(Exception):
    """A tool call's outcome fails the turn (unknown outcome, in-flight timeout, mismatch)."""

    def __init__(self, reason: str, error: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class ToolSteps:
    """Runs the tool calls of one attempt; :meth:`message` gathers one model message's."""

    def __init__(
        self,
        conversation_id: str,
        turn_id: str,
        attempt: int,
        output: AttemptOutput,
        writer: TurnWriter,
        metrics: Metrics,
        dispatcher: Dispatcher | None,
    ) -> None:
        self._conversation_id = conversation_id
        self._turn_id = turn_id
        self._n = attempt
        self._output = output
        self._writer = writer  # its fencing token goes with each dispatch, for the ledger
        self._metrics = metrics
        self._dispatcher = dispatcher
        self._ordinals: dict[str, int] = {}

    def message(self) -> ToolCalls:
        """The calls of the next model message."""
        return ToolCalls(self)

    async def run(
        self, call: dict[str, str], calls: list[dict[str, Any]], results: list[dict[str, Any]]
    ) -> None:
        """Dispatch one complete call through the ledger and put both sides on the stream.

        Raises :class:`ToolFailure` when its outcome fails the turn.
        """
        name = call["name"]
        ordinal = self._ordinals.get(name, 0)
        self._ordinals[name] = ordinal + 1
        call_id = call["id"] or f"call_{self._n}_{name}_{ordinal}"
        try:
            shown: Any = orjson.loads(call["arguments"] or "{}")
        except orjson.JSONDecodeError:
            shown = call["arguments"]
        await self._output.append(
            [
                (
                    "tool_call",
                    {
                        "attempt": self._n,
                        "call_id": call_id,
                        "name": name,
                        "args": shown,
                        "ordinal": ordinal,
                        "status": "dispatched",
                    },
                )
            ]
        )
        outcome = await self._dispatch(call, name, ordinal, call_id)
        data: dict[str, Any] = {
            "attempt": self._n,
            "call_id": call_id,
            "name": name,
            "ordinal": ordinal,
            "source": outcome.source,
            "status": "error" if outcome.error else "ok",
        }
        if outcome.error is not None:
            data["error"] = outcome.error
        else:
            data["result"] = outcome.result
        await self._output.append([("tool_result", data)])
        if outcome.fail_reason is not None:
            raise ToolFailure(outcome.fail_reason, outcome.error or {})
        calls.append({"id": call_id, "name": name, "arguments": call["arguments"]})
        content = outcome.error if outcome.error is not None else outcome.result
        results.append({"id": call_id, "name": name, "content": orjson.dumps(content).decode()})

    async def _dispatch(
        self, call: dict[str, str], name: str, ordinal: int, call_id: str
    ) -> Outcome:
        if self._dispatcher is None:
            return Outcome(
                "refused", error={"code": "unknown_tool", "message": "no tools are registered"}
            )
        slot = Slot(self._conversation_id, self._turn_id, name, ordinal)
        row = {"tool": name, "ordinal": ordinal, "attempt": self._n, "call_id": call_id}
        return await self._dispatcher.dispatch(slot, call["arguments"], row, self._writer.token)

    async def abandon(self, call: dict[str, str], *, show: bool) -> None:
        """A call cut off while its arguments arrived: recorded as not run, never dispatched.

        Readers are told (``show``) only when the attempt already reached them; otherwise a
        silent retry follows and the stream stays as if nothing happened.
        """
        row = {
            "tool": call["name"],
            "attempt": self._n,
            "call_id": call["id"],
            "state": "not_run",
            "reason": "connection_lost",
            "partial_arguments": call["arguments"],
        }
        if self._dispatcher is not None:
            await self._dispatcher.ledger.abandon(self._conversation_id, self._turn_id, row)
            tool = self._dispatcher.registry.get(call["name"])
            kind = tool.kind if tool is not None else "read"
            self._metrics.tool_calls.labels(kind, "not_run").inc()
        if not show:
            return
        with contextlib.suppress(StopRequested, StreamFull):
            await self._output.append(
                [
                    (
                        "tool_call",
                        {
                            "attempt": self._n,
                            "call_id": call["id"],
                            "name": call["name"],
                            "args": None,
                            "ordinal": None,
                            "status": "not_run",
                            "reason": "connection_lost",
                        },
                    )
                ]
            )


class ToolCalls:
    """The tool calls of one model message: chunks gathered per index until each call ends,
    and the calls run so far with their results (the next request's tool step)."""

    def __init__(self, steps: ToolSteps) -> None:
        self._steps = steps
        self._open: dict[int, dict[str, str]] = {}
        self.calls: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []

    def add(self, chunk: ToolCallChunk) -> None:
        """One piece of a call: its id and name (once), a piece of its arguments."""
        call = self._open.setdefault(chunk.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = chunk.call_id or call["id"]
        call["name"] = chunk.name or call["name"]
        call["arguments"] += chunk.arguments

    async def end(self, index: int) -> None:
        """The call at ``index`` is whole: run it (an index with no open call is ignored)."""
        if index in self._open:
            await self._steps.run(self._open.pop(index), self.calls, self.results)

    async def end_all(self) -> None:
        """The message ended: that completes its open calls, run in index order."""
        for index in sorted(self._open):
            await self._steps.run(self._open.pop(index), self.calls, self.results)

    async def abandon(self, *, show: bool) -> None:
        """The message was cut off: its open calls are not run (see :meth:`ToolSteps.abandon`)."""
        for index in sorted(self._open):
            await self._steps.abandon(self._open.pop(index), show=show)
