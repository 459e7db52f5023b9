"""Client tools: tools a turn offers the model that the broker does not run.

A turn's ``client_tools`` are offered to the model beside the server tools (the registry's,
run through the ledger). The model's calls to them are streamed to readers and end the attempt
``requires_action``; the client runs them and sends the results in its next turn, as ``tool``
messages answering the calls of an assistant message.

A client call's id is derived from its slot, as the ledger's key is (see
:func:`client_call_id`): a retried, regenerated or continued attempt that makes the same call
hands the client the same id, so that a client which deduplicates on it never runs it twice.
The provider's own call id (new on every response) is never shown.

The request shapes and their checks live here; the checks are pure and tested as tables.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from broker.errors import BadRequest
from broker.vocabulary import TOOL_NAME_PATTERN

MAX_CLIENT_TOOLS: Final = 128
CALL_ID_HEX: Final = 24  # hex digits of the slot's hash in a client call id


class ClientTool(BaseModel):
    """One entry of a turn's ``client_tools``: a function the client runs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN.pattern)
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema object for the arguments"
    )


class ToolCallPart(BaseModel):
    """One call of an assistant message in a request's history: ``arguments`` as JSON text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=128)
    arguments: str


def client_call_id(conversation_id: str, turn_id: str, name: str, ordinal: int) -> str:
    """The id of a client tool call: ``call_`` and the first 24 hex digits of the SHA-256 of
    its slot (conversation as the broker keys it, turn, tool name, ordinal of that tool's
    calls in the attempt), the slot the ledger keys a server call by."""
    slot = f"{conversation_id}\x00{turn_id}\x00{name}\x00{ordinal}"
    return "call_" + hashlib.sha256(slot.encode()).hexdigest()[:CALL_ID_HEX]


def check_client_tools(tools: Sequence[ClientTool], server_tools: Container[str]) -> None:
    """400 for more than :data:`MAX_CLIENT_TOOLS`, naming a client tool defined twice, or one
    that is also a server tool."""
    if len(tools) > MAX_CLIENT_TOOLS:
        raise BadRequest(f"client_tools has {len(tools)} tools, more than {MAX_CLIENT_TOOLS}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise BadRequest(f"client_tools[{i}].name {tool.name!r} is defined twice")
        if tool.name in server_tools:
            raise BadRequest(
                f"client_tools[{i}].name {tool.name!r} is a server tool of this broker "
                "(BROKER_TOOLS): choose another name"
            )
        seen.add(tool.name)


def check_tool_messages(messages: Sequence[dict[str, Any]]) -> None:
    """400 naming the first message whose tool fields do not fit: ``tool_calls`` on a message
    that is not the assistant's, a ``tool`` message without ``tool_call_id`` (or another role
    with one), or a ``tool_call_id`` that answers no call of an assistant message before it."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        tool_calls = message.get("tool_calls")
        answered = message.get("tool_call_id")
        if tool_calls is not None and role != "assistant":
            raise BadRequest(f"messages[{i}].tool_calls is only for assistant messages")
        if role == "tool" and answered is None:
            raise BadRequest(f"messages[{i}].tool_call_id is required for a tool message")
        if role != "tool" and answered is not None:
            raise BadRequest(f"messages[{i}].tool_call_id is only for tool messages")
        if answered is not None and answered not in calls:
            raise BadRequest(
                f"messages[{i}].tool_call_id {answered!r} answers no tool call of an "
                "assistant message before it"
            )
        for call in tool_calls or ():
            calls.add(str(call["id"]))


def offered_tools(client_tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Client tools in the OpenAI function format that ``tools`` uses (for adapters)."""
    offered = []
    for tool in client_tools:
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        offered.append({"type": "function", "function": function})
    return offered


# --- how the model may call: ``params.tool_choice`` and ``params.parallel_tool_calls`` ----------

# The params every provider takes beside its own: ``tool_choice`` is ``auto`` (the default),
# ``none``, ``required`` (at least one call) or ``{"name": <tool>}`` (a call of that tool);
# ``parallel_tool_calls: false`` asks for one call per message at most.
TOOL_PARAMS: Final = frozenset({"tool_choice", "parallel_tool_calls"})
CHOICES: Final = ("auto", "none", "required")


def check_tool_params(params: dict[str, Any]) -> None:
    """400 naming ``params.tool_choice`` or ``params.parallel_tool_calls`` when malformed."""
    choice = params.get("tool_choice")
    if isinstance(choice, dict) and set(choice) == {"name"}:
        name = choice["name"]
        if not (isinstance(name, str) and TOOL_NAME_PATTERN.fullmatch(name)):
            raise BadRequest("params.tool_choice.name must be a tool's name")
    elif choice is not None and choice not in CHOICES:
        raise BadRequest(
            "params.tool_choice must be 'auto', 'none', 'required' or {\"name\": <a tool>}"
        )
    parallel = params.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("params.parallel_tool_calls must be true or false")


def chosen_tool(params: dict[str, Any]) -> str | None:
    """The tool ``params.tool_choice`` names, if it names one."""
    choice = params.get("tool_choice")
    return str(choice["name"]) if isinstance(choice, dict) else None
