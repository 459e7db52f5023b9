"""What a Responses request sends the model: its ``instructions``, the context of its
``previous_response_id``, and its ``input`` items with every ``item_reference`` resolved.

OpenAI's rules, kept here: the instructions of a previous response are not carried over (the
new request's own replace them); the context of a previous response is its own input (minus its
instructions) and its answer, so a response can branch from any earlier one; a response made
with ``store: false`` cannot be a ``previous_response_id`` (400, ``previous_response_not_found``).

An ``item_reference`` names an item the broker minted (``msg_<attempt>_<response id>``: that
attempt's whole answer, as an assistant message) or an input message that the previous response,
or any response before it in its chain, was sent with an ``id``; anything else is a 400 naming
``input``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

from broker.dialects.openai.requests import (
    InputMessage,
    ItemReference,
    ParamError,
    ResponsesRequest,
    as_message,
    input_items,
)
from broker.dialects.openai.stored import find_continuation
from broker.dialects.openai.tools import add_call_item
from broker.errors import BrokerError
from broker.http import Services
from broker.turn_records import StoredRequest
from broker.vocabulary import AttemptStatus, unscoped

# The ids of the output messages the broker mints (see events.item_id).
MINTED: Final = re.compile(r"msg_([1-9][0-9]{0,5})_(.+)")


@dataclasses.dataclass(frozen=True, slots=True)
class Prior:
    """The response a request continues: where it lives and what it was made with."""

    response_id: str
    conversation_id: str  # scoped
    request: StoredRequest
    state: dict[str, Any]

    @property
    def _dropped(self) -> int:
        """How many leading messages were its instructions (0 or 1)."""
        instructions = self.request.echo.get("instructions")
        messages = self.request.messages
        return int(bool(instructions and messages and messages[0].get("content") == instructions))

    def input_ids(self, at: int) -> dict[str, int]:
        """The ids of the input messages of the chain so far, placed as :meth:`context` puts
        its messages from index ``at`` on."""
        ids = self.request.echo.get("input_ids") or {}
        shift = at - self._dropped
        return {k: v + shift for k, v in ids.items() if isinstance(v, int) and v >= self._dropped}

    def context(self) -> list[dict[str, Any]]:
        """Its input without its instructions, then its canonical answer (flagged ``partial``
        when it was cut short, as the native history does)."""
        messages = [dict(m) for m in self.request.messages[self._dropped :]]
        canonical = self.state.get("canonical")
        if canonical:
            answer: dict[str, Any] = {"role": "assistant", "content": canonical["text"] or ""}
            record: dict[str, Any] = next(
                (a for a in self.state["attempts"] if a["n"] == canonical["attempt"]), {}
            )
            pending = self.state.get("tool_calls")
            if pending:  # it ended with client tool calls, whose outputs this input may hold
                answer["tool_calls"] = [
                    {"id": c["call_id"], "name": c["name"], "arguments": c["arguments"]}
                    for c in pending
                ]
            elif record.get("status") != AttemptStatus.COMPLETE:
                answer["partial"] = True
            messages.append(answer)
        return messages

    def input_message(self, item_id: str) -> dict[str, Any] | None:
        """The input message it was sent with under ``item_id``, if any."""
        index = self.request.echo.get("input_ids", {}).get(item_id)
        if not isinstance(index, int) or not 0 <= index < len(self.request.messages):
            return None
        message = self.request.messages[index]
        return {"role": message.get("role"), "content": message.get("content")}


async def prior(rt: Services, response_id: str, tenant: str | None) -> Prior:
    """The previous response; 400 naming ``previous_response_id`` when there is none to use. A
    continuation (see :mod:`broker.dialects.openai.approvals`) is its turn's: its context is the
    turn's input and whole answer."""
    not_found = ParamError(
        f"previous response with id {response_id[:128]!r} not found",
        "previous_response_id",
        code="previous_response_not_found",
    )
    try:
        continued = await find_continuation(rt, response_id, tenant)
        turn_id = continued[0].location.turn_id if continued is not None else response_id
        state = await rt.turns.get(turn_id, tenant)
    except BrokerError as exc:
        if exc.status == 404:
            raise not_found from None
        raise ParamError(exc.message, "previous_response_id", code=exc.code) from None
    conversation_id = await rt.turns.locate(turn_id, tenant)
    request = await rt.turns.request(conversation_id, turn_id)
    if request.echo.get("store") is False:
        raise not_found  # OpenAI: a response not stored cannot be continued
    return Prior(response_id, conversation_id, request, state)


async def _minted(rt: Services, item_id: str, tenant: str | None) -> dict[str, Any] | None:
    """The answer of the attempt a minted item id names, as an assistant message."""
    match = MINTED.fullmatch(item_id)
    if match is None:
        return None
    attempt, response_id = int(match[1]), match[2]
    found = await rt.turns.find(response_id, tenant)
    if found is None:
        return None
    conversation_id = await rt.turns.locate(response_id, tenant)
    ended = await rt.turns.attempt(conversation_id, response_id, attempt)
    if ended.record is None:
        return None
    return {"role": "assistant", "content": ended.text}


async def resolve(
    rt: Services, reference: ItemReference, before: Prior | None, tenant: str | None
) -> dict[str, Any]:
    """An ``item_reference`` as the message it names; 400 naming ``input`` when unknown."""
    found = await _minted(rt, reference.id, tenant)
    if found is None and before is not None:
        found = before.input_message(reference.id)
    if found is None:
        raise ParamError(
            f"input: item_reference to {reference.id[:128]!r}, which is no item of this "
            "broker's (it resolves the ids of its output messages, and of the input messages "
            "the previous_response_id was sent with)",
            "input",
            code="unknown_item_reference",
        )
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """A request's messages for the model, its conversation, and the ids of its input items."""

    conversation_id: str  # the client's own, unscoped
    messages: list[dict[str, Any]]
    input_ids: dict[str, int]


async def context(
    rt: Services, body: ResponsesRequest, turn_id: str, tenant: str | None
) -> Context:
    """The messages a new response sends, from its request (see the module's docstring)."""
    before = None
    if body.previous_response_id is not None:
        before = await prior(rt, body.previous_response_id, tenant)
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    input_ids: dict[str, int] = {}
    if before is not None:
        # The chain's input ids carry on, so a reference reaches any earlier response's input.
        input_ids.update(before.input_ids(len(messages)))
        messages += before.context()
    start = len(messages)
    for n, item in enumerate(input_items(body)):
        if isinstance(item, InputMessage):
            if item.id is not None:
                input_ids[item.id] = len(messages)
            messages.append(as_message(item, n))
        elif isinstance(item, ItemReference):
            messages.append(await resolve(rt, item, before, tenant))
        else:
            add_call_item(messages, item)
    if not any(m["role"] != "system" for m in messages[start:]):
        raise ParamError("input must hold at least one message", "input", code="empty_input")
    conversation_id = turn_id if before is None else unscoped(before.conversation_id)[1]
    return Context(conversation_id, messages, input_ids)
