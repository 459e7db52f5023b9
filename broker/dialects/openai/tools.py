"""Function tools through the OpenAI doors: the request shapes of ``tools``, ``tool_choice``,
``parallel_tool_calls`` and the messages that carry calls and their results, and their
translation to the native turn's ``client_tools`` and :class:`~broker.turns.Message` fields
(see :mod:`broker.client_tools`). Pure, and tested as tables.

``tool_choice`` ``none`` offers no tools; ``required``, a named function and
``parallel_tool_calls: false`` travel to the providers as the turn's params (see
:func:`broker.dialects.openai.requests.tool_params` and
:data:`broker.client_tools.TOOL_PARAMS`), which every provider honours.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.vocabulary import TOOL_NAME_PATTERN


class FunctionDefinition(BaseModel):
    """A Chat Completions tool's ``function``. ``strict`` is taken and not enforced (the
    arguments are whatever the model sent; see docs/openai.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN.pattern)
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of a Chat Completions request's ``tools``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128)
    arguments: str


class ChatToolCall(BaseModel):
    """One call of an assistant message of a Chat Completions request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CallFunction


def client_tool(
    name: str, description: str | None, parameters: dict[str, Any] | None
) -> dict[str, Any]:
    """One native ``client_tools`` entry."""
    tool: dict[str, Any] = {"name": name}
    if description is not None:
        tool["description"] = description
    if parameters is not None:
        tool["parameters"] = parameters
    return tool


def chat_client_tools(tools: list[ChatTool] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """A Chat Completions request's ``tools`` as the native ``client_tools`` (none offered for
    ``tool_choice`` ``none``)."""
    if tool_choice == "none":
        return []
    return [
        client_tool(t.function.name, t.function.description, t.function.parameters)
        for t in tools or ()
    ]


def native_calls(calls: list[ChatToolCall]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the native message's."""
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


def chat_calls(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn's ``tool_calls`` (``call_id``, ``name``, ``arguments``) as a Chat Completions
    message's."""
    return [
        {
            "id": call["call_id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
        for call in pending
    ]


def renamed(message: str, messages: str) -> tuple[str, str | None]:
    """A 400 of the core's tool checks as the door's, and the parameter at fault:
    ``client_tools`` is ``tools`` here, and ``messages`` the door's input (``messages``)."""
    if message.startswith("client_tools"):
        return "tools" + message.removeprefix("client_tools"), "tools"
    if message.startswith("messages[") and ("tool_call" in message):
        if messages == "messages":
            return message, messages
        return f"{messages}: {message} (of the messages it makes)", messages
    return message, None


# --- Responses ----------------------------------------------------------------------------------


class ResponsesTool(BaseModel):
    """One entry of a Responses request's ``tools``: a function (``strict`` taken, not
    enforced). Other tool types are refused by name before this model is tried."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN.pattern)
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionCallItem(BaseModel):
    """A ``function_call`` input item: a call the model made earlier."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=128)
    arguments: str
    id: str | None = Field(default=None, max_length=256)
    status: str | None = Field(default=None, max_length=32)
    # The SDKs' parsed copy of ``arguments`` on the items of a response they parsed, sent back
    # when a client appends ``response.output`` to its input: nothing of its own to honour.
    parsed_arguments: Any = None


class FunctionCallOutputItem(BaseModel):
    """A ``function_call_output`` input item: the client's result of a call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = Field(default=None, max_length=256)
    status: str | None = Field(default=None, max_length=32)


def responses_client_tools(tools: list[ResponsesTool], tool_choice: Any) -> list[dict[str, Any]]:
    """A Responses request's ``tools`` as the native ``client_tools``."""
    if tool_choice == "none":
        return []
    return [client_tool(t.name, t.description, t.parameters) for t in tools]


def add_call_item(
    messages: list[dict[str, Any]], item: FunctionCallItem | FunctionCallOutputItem
) -> None:
    """A function call item appended to the native messages: a call joins the assistant
    message before it (a new one if the last message is not the assistant's), an output is a
    ``tool`` message."""
    if isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        return
    call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
    if any(c["id"] == item.call_id for m in messages for c in m.get("tool_calls") or ()):
        return  # already there: the previous response's own call, sent back
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("partial"):
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)
