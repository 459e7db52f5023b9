"""Client tool calls through the Responses door: ``function_call`` output items and their events.

A response whose request has ``tools`` is always read from its stream's origin (its sequence
numbers then follow from what was read, not from the seek table), so that the renderer knows
each call's place among the output items. For each call of a client tool:

==================  ==========================================================================
stored              Responses events
==================  ==========================================================================
tool_input_delta    the call's first: ``response.output_item.added`` (a ``function_call`` item
                    ``in_progress``), then ``response.function_call_arguments.delta``
tool_call client    (``output_item.added`` and the whole arguments as one delta when no piece
                    came), ``response.function_call_arguments.done``, ``output_item.done``
tool_call not_run   ``response.output_item.done`` with the item ``incomplete`` (its arguments
                    never whole: never a call to run)
==================  ==========================================================================

The item id is ``fc_<attempt>_`` and the call id's hash (``call_...``); the call id is the
same across a retry (see :mod:`broker.client_tools`). The response that ends ``requires_action`` is
``completed``, with the calls (completed ones only) after the attempt's message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson


def call_item_id(attempt: int, call_id: str) -> str:
    return f"fc_{attempt}_{call_id.removeprefix('call_')}"


def call_item(attempt: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """One ``function_call`` output item of an attempt."""
    return {
        "id": call_item_id(attempt, call_id),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def pending_items(attempt: int, pending: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn's ``tool_calls`` (the calls its canonical attempt ended with) as items."""
    return [
        call_item(attempt, c["call_id"], c["name"], c["arguments"], "completed") for c in pending
    ]


def function_tools(client_tools: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn's client tools as the response object's ``tools``."""
    return [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": None,
        }
        for tool in client_tools
    ]


class Calls:
    """The output items of a read read from the origin: each attempt's message index, and the
    function calls of the current attempt with their index and arguments so far."""

    def __init__(self) -> None:
        self.items = 0  # output items added so far in this read
        self.messages: dict[int, int] = {}  # attempt -> its message's output index
        self.attempt = 0
        self.index: dict[str, int] = {}
        self.arguments: dict[str, str] = {}
        self.completed: list[dict[str, Any]] = []

    def start(self, attempt: int) -> int:
        """A new attempt: its message's output index (its calls come after it)."""
        self.attempt = attempt
        self.index, self.arguments, self.completed = {}, {}, []
        self.messages[attempt] = self.items
        self.items += 1
        return self.messages[attempt]

    def events(self, kind: str, data: dict[str, Any]) -> list[dict[str, Any]]:
        """The Responses events of a client call's stored event (unnumbered)."""
        call_id, name = str(data.get("call_id")), str(data.get("name"))
        if kind == "tool_input_delta":
            return [*self._added(call_id, name), self._delta(call_id, str(data.get("delta", "")))]
        status = data.get("status")
        if status == "client":
            events = []
            if call_id not in self.index:
                whole = orjson.dumps(data.get("args", {})).decode()
                events = [*self._added(call_id, name), self._delta(call_id, whole)]
            done = self._done(call_id, name, "completed")
            self.completed.append(done["item"])
            arguments = {
                "type": "response.function_call_arguments.done",
                "item_id": call_item_id(self.attempt, call_id),
                "output_index": self.index[call_id],
                "name": name,
                "arguments": self.arguments[call_id],
            }
            return [*events, arguments, done]
        if status == "not_run" and call_id in self.index:
            return [self._done(call_id, name, "incomplete")]
        return []

    def _added(self, call_id: str, name: str) -> list[dict[str, Any]]:
        if call_id in self.index:
            return []
        self.index[call_id] = self.items
        self.items += 1
        self.arguments[call_id] = ""
        item = call_item(self.attempt, call_id, name, "", "in_progress")
        return [
            {
                "type": "response.output_item.added",
                "output_index": self.index[call_id],
                "item": item,
            }
        ]

    def _delta(self, call_id: str, delta: str) -> dict[str, Any]:
        self.arguments[call_id] += delta
        return {
            "type": "response.function_call_arguments.delta",
            "item_id": call_item_id(self.attempt, call_id),
            "output_index": self.index[call_id],
            "delta": delta,
        }

    def _done(self, call_id: str, name: str, status: str) -> dict[str, Any]:
        item = call_item(self.attempt, call_id, name, self.arguments[call_id], status)
        return {
            "type": "response.output_item.done",
            "output_index": self.index[call_id],
            "item": item,
        }
