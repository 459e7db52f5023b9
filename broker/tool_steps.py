"""The tool calls of one attempt: assembled from the model's chunks, dispatched through the
ledger as soon as each is whole, and shown on the stream as a ``tool_call`` and its
``tool_result``.

A call is named by its tool and its ordinal (the how-many-th call of that tool in the attempt,
counted across its steps and upstream calls): that is the ledger slot which makes a call that is
run again (a retry, a takeover) find its stored outcome instead of running twice.

A call of one of the turn's client tools is not dispatched: its arguments are streamed as
``tool_input_delta`` events as they arrive, then it is shown as a ``tool_call`` with status
``client`` and left :attr:`ToolSteps.pending`, for the attempt to end with (``requires_action``).
Its id is derived from its slot (:func:`~broker.client_tools.client_call_id`), so a retry meets
the same id.

A server call whose tool's rule asks for a person's approval is claimed as
``awaiting_approval`` (no dispatch), shown with an ``approval_request`` event and left
:attr:`ToolSteps.awaiting`: the attempt parks once its message ended, and runs the call (or tells
the model it was declined) when the decision came (:meth:`ToolSteps.resolve`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

from broker.approval_rules import request_event
from broker.client_tools import client_call_id
from broker.errors import StopRequested, StreamFull
from broker.lease import TurnWriter
from broker.ledger import Dispatcher, Outcome, Slot
from broker.metrics import Metrics
from broker.output import AttemptOutput
from broker.providers import ToolCallChunk, ToolStep


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
        self._client: frozenset[str] = frozenset()
        self.pending: list[dict[str, Any]] = []  # client calls whole: {call_id, name, arguments}
        # Server calls waiting for a person: {call_id, name, ordinal, arguments, approval_id,
        # expires_ms}.
        self.awaiting: list[dict[str, Any]] = []

    def restart(self, client_tools: frozenset[str]) -> None:
        """A new upstream call redoes the attempt's steps: ordinals count from 0 again (to
        meet the same slots), and nothing is pending."""
        self._client = client_tools
        self._ordinals = {}
        self.pending = []
        self.awaiting = []

    def parked(self) -> dict[str, Any]:
        """What a parked attempt needs to go on (stored in its record): its ordinals so far,
        its client calls pending, its calls awaiting a decision."""
        return {"ordinals": self._ordinals, "pending": self.pending, "awaiting": self.awaiting}

    def restore(self, parked: dict[str, Any]) -> None:
        """Go on from :meth:`parked`'s state (a resumed attempt, after :meth:`restart`)."""
        self._ordinals = dict(parked.get("ordinals") or {})
        self.pending = list(parked.get("pending") or ())
        self.awaiting = list(parked.get("awaiting") or ())

    async def resolve(self, step: ToolStep) -> None:
        """The calls that waited for a person were decided: each goes through the ledger now
        (approved: it runs once; declined: the model is told) and joins ``step``'s calls and
        results. Raises :class:`ToolFailure` when an outcome fails the turn."""
        awaiting, self.awaiting = self.awaiting, []
        for call in awaiting:
            name, ordinal, call_id = call["name"], call["ordinal"], call["call_id"]
            outcome = await self._dispatch({"arguments": call["arguments"]}, name, ordinal, call_id)
            if outcome.source == "awaiting":  # decided, then met again: never run unapproved
                outcome = Outcome(
                    "refused",
                    error={"code": "awaiting_approval", "message": f"{name} is not approved"},
                )
            await self._show_outcome(call, name, ordinal, call_id, outcome, step)

    def is_client(self, name: str) -> bool:
        """Whether ``name`` is one of the turn's client tools (the client runs its calls)."""
        return name in self._client

    def _next_ordinal(self, name: str) -> int:
        ordinal = self._ordinals.get(name, 0)
        self._ordinals[name] = ordinal + 1
        return ordinal

    def message(self) -> ToolCalls:
        """The calls of the next model message."""
        return ToolCalls(self)

    async def run(
        self, call: dict[str, Any], calls: list[dict[str, Any]], results: list[dict[str, Any]]
    ) -> None:
        """Dispatch one complete call through the ledger and put both sides on the stream.

        Raises :class:`ToolFailure` when its outcome fails the turn.
        """
        if self.is_client(call["name"]):
            await self.hand_over(call, calls, results)
            return
        name = call["name"]
        ordinal = self._next_ordinal(name)
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
        if outcome.source == "awaiting" and outcome.approval is not None:
            approval = outcome.approval
            self.awaiting.append(
                {
                    "call_id": call_id,
                    "name": name,
                    "ordinal": ordinal,
                    "arguments": call["arguments"],
                    "approval_id": approval.approval_id,
                    "expires_ms": approval.expires_ms,
                }
            )
            event = request_event(
                self._n, approval.approval_id, call_id, name, ordinal, shown, approval.expires_ms
            )
            await self._output.append([event])
            return
        await self._show_outcome(
            call, name, ordinal, call_id, outcome, ToolStep("", calls, results)
        )

    async def _show_outcome(
        self,
        call: dict[str, Any],
        name: str,
        ordinal: int,
        call_id: str,
        outcome: Outcome,
        step: ToolStep,
    ) -> None:
        """Put a dispatched call's ``tool_result`` on the stream and its result in ``step``."""
        calls, results = step.calls, step.results
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

    async def stream_input(self, call: dict[str, Any]) -> None:
        """A client call's arguments so far: the piece not yet shown goes out as a
        ``tool_input_delta`` (its slot and id are taken with its first piece)."""
        if "ordinal" not in call:
            call["ordinal"] = self._next_ordinal(call["name"])
            call["call_id"] = client_call_id(
                self._conversation_id, self._turn_id, call["name"], call["ordinal"]
            )
            call["shown"] = 0
        piece = call["arguments"][call["shown"] :]
        if not piece:
            return
        call["shown"] = len(call["arguments"])
        data = {
            "attempt": self._n,
            "call_id": call["call_id"],
            "name": call["name"],
            "ordinal": call["ordinal"],
            "delta": piece,
        }
        await self._output.queue_event(("tool_input_delta", data))

    async def hand_over(
        self, call: dict[str, Any], calls: list[dict[str, Any]], results: list[dict[str, Any]]
    ) -> None:
        """A client call whose arguments are whole: shown ``client`` and left pending; with
        arguments that are not JSON, shown ``not_run`` (``bad_arguments``) and answered to the
        model with an error, as a refused server call is."""
        await self.stream_input(call)
        arguments = call["arguments"] or "{}"
        data: dict[str, Any] = {
            "attempt": self._n,
            "call_id": call["call_id"],
            "name": call["name"],
            "ordinal": call["ordinal"],
        }
        try:
            data["args"] = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            data.update(args=arguments, status="not_run", reason="bad_arguments")
            await self._output.append([("tool_call", data)])
            error = {"code": "bad_arguments", "message": "the arguments are not JSON"}
            calls.append({"id": call["call_id"], "name": call["name"], "arguments": arguments})
            content = orjson.dumps(error).decode()
            results.append({"id": call["call_id"], "name": call["name"], "content": content})
            return
        data["status"] = "client"
        await self._output.append([("tool_call", data)])
        self.pending.append(
            {"call_id": call["call_id"], "name": call["name"], "arguments": arguments}
        )

    async def _dispatch(
        self, call: dict[str, Any], name: str, ordinal: int, call_id: str
    ) -> Outcome:
        if self._dispatcher is None:
            return Outcome(
                "refused", error={"code": "unknown_tool", "message": "no tools are registered"}
            )
        slot = Slot(self._conversation_id, self._turn_id, name, ordinal)
        row = {"tool": name, "ordinal": ordinal, "attempt": self._n, "call_id": call_id}
        return await self._dispatcher.dispatch(slot, call["arguments"], row, self._writer.token)

    async def abandon(self, call: dict[str, Any], *, show: bool) -> None:
        """A call cut off while its arguments arrived: recorded as not run, never dispatched
        (a client call: never handed over).

        Readers are told (``show``) only when the attempt already reached them; otherwise a
        silent retry follows and the stream stays as if nothing happened.
        """
        if "ordinal" in call:  # a client call: its id and slot were shown with its input
            if show:
                await self._show_not_run(call["call_id"], call["name"], call["ordinal"])
            return
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
        if show:
            await self._show_not_run(call["id"], call["name"], None)

    async def _show_not_run(self, call_id: str, name: str, ordinal: int | None) -> None:
        with contextlib.suppress(StopRequested, StreamFull):
            await self._output.append(
                [
                    (
                        "tool_call",
                        {
                            "attempt": self._n,
                            "call_id": call_id,
                            "name": name,
                            "args": None,
                            "ordinal": ordinal,
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
        self._open: dict[int, dict[str, Any]] = {}
        self.calls: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []

    async def add(self, chunk: ToolCallChunk) -> None:
        """One piece of a call: its id and name (once), a piece of its arguments (a client
        call's is shown at once)."""
        call = self._open.setdefault(chunk.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = chunk.call_id or call["id"]
        call["name"] = chunk.name or call["name"]
        call["arguments"] += chunk.arguments
        if call["name"] and self._steps.is_client(call["name"]):
            await self._steps.stream_input(call)

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
