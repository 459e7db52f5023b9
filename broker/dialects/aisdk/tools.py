"""Client tools through the AI SDK door: the ``tools`` a chat declares, the tool parts of its
assistant messages as the core's calls and results, and the turn that answers them. Pure, and
tested as tables.

The AI SDK keeps a chat's tool definitions on the server route; the broker is that route, so a
``useChat`` app declares them in the request body (the transport's ``body`` option): ``tools``,
an object from tool name to ``{"description"?, "inputSchema"?}`` (a JSON Schema object), the
core's ``client_tools``. The model's calls come out as the AI SDK's tool parts; the client runs
them (``onToolCall``, ``addToolOutput``) and sends the chat again, its last message the assistant
one with the outputs. That request is a turn of its own, a *follow-up*: its id is the assistant
message's id and a digest of the request's messages and of the attempt whose calls they answer
(:func:`follow_up_turn_id`), so the same request sent twice is one turn, and its answer goes on
in the same assistant message (:func:`reply_id`). It keeps the message's parts and the turn it
answers with its request (``echo``): a resume that replays it from ``start`` rebuilds the steps
before it (:func:`prelude`), and finds that turn when it runs again (a regenerate).

Parts with ``providerExecuted`` (the broker's own calls through the ledger, and calls it refused)
are the broker's business: their results were part of the attempt, and they are not sent again.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Final

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.api.errors import describe_validation
from broker.approval_rules import MAX_REASON_CHARS
from broker.errors import BadRequest
from broker.vocabulary import ID_PATTERN, TOOL_NAME_PATTERN

# The id of a follow-up turn: the assistant message's id, then this, then 16 hex digits.
FOLLOW_UP_MARK: Final = ".tools-"
DIGEST_HEX: Final = 16
FOLLOW_UP = re.compile(r"^(?P<reply>.+)\.tools-[0-9a-f]{16}$")
MAX_REPLY_ID: Final = 128 - len(FOLLOW_UP_MARK) - DIGEST_HEX
# The states of a tool part a request may hold, and those that carry a result.
RESULT_STATES: Final = frozenset({"output-available", "output-error"})
PENDING_STATES: Final = frozenset({"input-streaming", "input-available"})


class UITool(BaseModel):
    """One entry of a chat request's ``tools``: a tool the client runs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    description: str | None = Field(default=None, max_length=4096)
    inputSchema: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema object for the tool's input"
    )


class ToolPart(BaseModel):
    """The fields of a tool part of an assistant message that the broker reads."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    toolCallId: str = Field(min_length=1, max_length=128)
    state: str = Field(min_length=1, max_length=64)
    toolName: str | None = Field(default=None, min_length=1, max_length=128)
    input: Any = None
    output: Any = None
    errorText: str | None = None
    providerExecuted: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolPart:
        if self.type == "dynamic-tool" and self.toolName is None:
            raise ValueError("a dynamic-tool part needs its toolName")
        return self

    @property
    def name(self) -> str:
        if self.type == "dynamic-tool" and self.toolName is not None:
            return self.toolName
        return self.type.removeprefix("tool-")


def is_tool_part(part_type: str) -> bool:
    return part_type.startswith("tool-") or part_type == "dynamic-tool"


def client_tools(tools: dict[str, UITool] | None) -> list[dict[str, Any]]:
    """A request's ``tools`` as the core's ``client_tools``; 400 naming a name it cannot take."""
    offered: list[dict[str, Any]] = []
    for name, tool in (tools or {}).items():
        if not TOOL_NAME_PATTERN.fullmatch(name):
            raise BadRequest(
                f"tools: {name[:80]!r} is not a usable tool name: a letter, then letters, "
                "digits, _ . - (at most 64)"
            )
        entry: dict[str, Any] = {"name": name}
        if tool.description is not None:
            entry["description"] = tool.description
        if tool.inputSchema is not None:
            entry["parameters"] = tool.inputSchema
        offered.append(entry)
    return offered


def renamed(error: BadRequest) -> BadRequest:
    """A 400 of the core's client tool checks in this door's words (``tools``)."""
    if not error.message.startswith("client_tools"):
        return error
    message = error.message.removeprefix("client_tools")
    name = re.match(r"^\[\d+\]\.name ('.*?') ", message)
    if name is not None:
        message = f".{name.group(1)[1:-1]} " + message[name.end() :]
    return BadRequest("tools" + message, code=error.code)


def _tool_part(part: dict[str, Any], where: str) -> ToolPart:
    try:
        tool = ToolPart.model_validate(part)
    except ValidationError as exc:
        raise BadRequest(f"{where}: {describe_validation(exc.errors())}") from None
    if tool.state not in RESULT_STATES | PENDING_STATES:
        raise BadRequest(
            f"{where}.state {tool.state!r} is not taken here: a client tool part is "
            "input-available, output-available or output-error"
        )
    return tool


def _result(tool: ToolPart) -> str:
    """A tool part's result as a ``tool`` message's content: text as it is, other JSON as text."""
    if tool.state == "output-error":
        return tool.errorText or "error"
    if isinstance(tool.output, str):
        return tool.output
    return orjson.dumps(tool.output).decode()


class _Segments:
    """An assistant message's parts cut into model messages: text, then the calls that end it,
    then their results."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._text: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._results: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    def text(self, text: str) -> None:
        if self._calls:
            self.flush()
        self._text.append(text)

    def call(self, tool: ToolPart) -> None:
        if tool.toolCallId in self._ids:
            return  # the same slot called again (a continued attempt): one call, one result
        self._ids.add(tool.toolCallId)
        arguments = orjson.dumps(tool.input if tool.input is not None else {}).decode()
        self._calls.append({"id": tool.toolCallId, "name": tool.name, "arguments": arguments})
        self._results.append(
            {"role": "tool", "content": _result(tool), "tool_call_id": tool.toolCallId}
        )

    def flush(self) -> None:
        if not self._text and not self._calls:
            return
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._text)}
        if self._calls:
            message["tool_calls"] = self._calls
        self.messages += [message, *self._results]
        self._text, self._calls, self._results = [], [], []


def assistant_messages(
    parts: Sequence[dict[str, Any]], where: str, last: bool
) -> list[dict[str, Any]]:
    """The native messages of one assistant UI message (``where``: its place, for a 400): its
    text, and each client tool call with a result as an assistant call and a ``tool`` message.
    A call without a result is left out of an earlier message (never answered: the chat went
    on); in the last message it is a 400, since the turn would answer it. A call id met again
    in the message (the same slot, called again by a continued attempt) is one call."""
    segments = _Segments()
    for j, part in enumerate(parts):
        kind = str(part.get("type"))
        if kind == "text":
            segments.text(str(part.get("text")))
        elif is_tool_part(kind):
            tool = _tool_part(part, f"{where}.parts[{j}]")
            if tool.providerExecuted:
                continue  # the broker's own call: its result was part of that attempt
            if tool.state in RESULT_STATES:
                segments.call(tool)
            elif last:
                raise BadRequest(
                    f"{where}.parts[{j}]: tool call {tool.toolCallId!r} has no output yet: "
                    "send the chat once every call of the message has its output"
                )
    segments.flush()
    return segments.messages or [{"role": "assistant", "content": ""}]


# The state of a tool part a person answered with ``addToolApprovalResponse``.
APPROVAL_RESPONDED: Final = "approval-responded"


class ApprovalAnswer(BaseModel):
    """A tool part's ``approval`` once a person answered it."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str = Field(min_length=1, max_length=128)
    approved: bool
    reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)


def approval_answers(parts: Sequence[dict[str, Any]], where: str) -> list[ApprovalAnswer]:
    """The approvals a message's tool parts answer (state ``approval-responded``), in order;
    400 naming a part whose ``approval`` does not fit."""
    answers: list[ApprovalAnswer] = []
    for j, part in enumerate(parts):
        if not is_tool_part(str(part.get("type"))) or part.get("state") != APPROVAL_RESPONDED:
            continue
        try:
            answers.append(ApprovalAnswer.model_validate(part.get("approval")))
        except ValidationError as exc:
            detail = describe_validation(exc.errors())
            raise BadRequest(f"{where}.parts[{j}].approval: {detail}") from None
    return answers


def answered_turn(reply: str, parts: Sequence[dict[str, Any]]) -> str:
    """The turn whose approvals a message answers: the one its ``data-broker`` part names,
    else the one its id names (``<turn_id>-reply``)."""
    answered = answered_attempt(parts)
    if answered and isinstance(answered[0], str):
        return answered[0]
    return reply.removesuffix("-reply")


def answered_attempt(parts: Sequence[dict[str, Any]]) -> list[Any]:
    """The turn and attempt whose calls a message's outputs answer, as its ``data-broker``
    part says (empty without one): a regenerated answer's calls keep their ids, and it is
    this that makes their outputs another turn than the first answer's."""
    for part in parts:
        data = part.get("data")
        if part.get("type") == "data-broker" and isinstance(data, dict):
            return [data.get("turnId"), data.get("attempt")]
    return []


def follow_up_turn_id(
    chat_id: str, reply: str, messages: Sequence[dict[str, Any]], answered: Sequence[Any] = ()
) -> str:
    """The turn that answers tool results: the assistant message's id (``reply``) and a digest
    of the chat, its messages and the attempt ``answered``, so the same request is the same
    turn, and the outputs of a regenerated answer's calls another one."""
    if len(reply) > MAX_REPLY_ID or not ID_PATTERN.fullmatch(reply):
        raise BadRequest(
            f"message id {reply[:80]!r} is not a usable assistant message id for a turn that "
            f"answers tool results: 1-{MAX_REPLY_ID} of A-Z a-z 0-9 . _ : -",
            code="bad_message_id",
        )
    payload = orjson.dumps([chat_id, list(messages), list(answered)], option=orjson.OPT_SORT_KEYS)
    return f"{reply}{FOLLOW_UP_MARK}{hashlib.sha256(payload).hexdigest()[:DIGEST_HEX]}"


def reply_id(turn_id: str) -> str:
    """The id of the assistant message a turn's answer is shown in: a follow-up turn's goes on
    in the message whose tool calls it answers; any other turn's is its own."""
    follow_up = FOLLOW_UP.fullmatch(turn_id)
    if follow_up is not None:
        return follow_up.group("reply")
    return f"{turn_id}-reply"


# The parts of the message a follow-up turn goes on in, kept with its request (``echo``), for a
# replay of its answer to show the steps before it: what the AI SDK keeps of them.
PRELUDE_PARTS: Final = "reply_parts"
# The turn whose calls a follow-up answers (as the message's ``data-broker`` part names it), kept
# with its request: a resume finds that turn when it runs again (a regenerate).
ANSWERS: Final = "answers"


def kept_parts(parts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parts of a follow-up's message that its replay shows again: steps, text, tools."""
    kept: list[dict[str, Any]] = []
    for part in parts:
        kind = str(part.get("type"))
        if kind == "step-start":
            kept.append({"type": kind})
        elif kind == "text":
            kept.append({"type": kind, "text": part.get("text")})
        elif is_tool_part(kind):
            fields = ("toolCallId", "toolName", "state", "input", "output", "errorText")
            tool = {k: part[k] for k in fields if part.get(k) is not None}
            kept.append(
                {"type": kind, **tool, "providerExecuted": bool(part.get("providerExecuted"))}
            )
    return kept


def _prelude_tool(part: dict[str, Any]) -> list[dict[str, Any]]:
    """A tool part as chunks that rebuild it. A client call is rebuilt from its input, never
    made ``tool-input-available`` again: that would hand it to ``onToolCall`` a second time."""
    call_id, state = part["toolCallId"], part["state"]
    name = part.get("toolName") if part["type"] == "dynamic-tool" else part["type"][5:]
    head: dict[str, Any] = {"toolCallId": call_id, "toolName": name}
    if part["type"] == "dynamic-tool":
        head["dynamic"] = True
    own = {"providerExecuted": True} if part["providerExecuted"] else {}
    if own:
        chunks = [{"type": "tool-input-available", **head, "input": part.get("input"), **own}]
    else:
        text = orjson.dumps(part.get("input") if part.get("input") is not None else {}).decode()
        chunks = [
            {"type": "tool-input-start", **head},
            {"type": "tool-input-delta", "toolCallId": call_id, "inputTextDelta": text},
        ]
    if state == "output-available":
        chunks.append(
            {
                "type": "tool-output-available",
                "toolCallId": call_id,
                "output": part.get("output"),
                **own,
            }
        )
    elif state == "output-error":
        error = str(part.get("errorText") or "error")
        chunks.append(
            {"type": "tool-output-error", "toolCallId": call_id, "errorText": error, **own}
        )
    return chunks


def prelude(parts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks that rebuild the steps a follow-up turn's message had before it (its kept
    parts), for a replay from ``start``: each step, its text (ids ``0-<n>``) and its tools."""
    chunks: list[dict[str, Any]] = []
    step_open, texts = False, 0
    for part in parts:
        if part["type"] == "step-start" or not step_open:
            if step_open:
                chunks.append({"type": "finish-step"})
            chunks.append({"type": "start-step"})
            step_open = True
            if part["type"] == "step-start":
                continue
        if part["type"] == "text":
            texts += 1
            text_id = f"0-{texts}"
            chunks += [
                {"type": "text-start", "id": text_id},
                {"type": "text-delta", "id": text_id, "delta": str(part.get("text") or "")},
                {"type": "text-end", "id": text_id},
            ]
        else:
            chunks += _prelude_tool(part)
    if step_open:
        chunks.append({"type": "finish-step"})
    return chunks
