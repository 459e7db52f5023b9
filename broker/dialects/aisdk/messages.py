"""The AI SDK's chat request, and its translation to a broker :class:`TurnRequest`.

The chat id is the conversation id and the id of the last user message, minted by the client,
is the turn id: the same message sent twice (two tabs, a double click) is one turn. A chat whose
last message is the assistant's, with the outputs of its client tool calls, is a follow-up turn
that answers them (see :mod:`broker.dialects.aisdk.tools`). Text parts, the image files of user
messages (``file`` parts whose ``mediaType`` is an image, by URL or data URL) and the client tool
parts of assistant messages reach the model; data parts, reasoning and the broker's own tool
parts of the history are skipped, and a file that is not an image is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.api.errors import describe_validation
from broker.client_tools import ClientTool
from broker.dialects.aisdk.tools import (
    ANSWERS,
    PRELUDE_PARTS,
    ApprovalAnswer,
    UITool,
    answered_attempt,
    answered_turn,
    approval_answers,
    assistant_messages,
    client_tools,
    follow_up_turn_id,
    kept_parts,
)
from broker.errors import BadRequest
from broker.turns import Message, TurnRequest
from broker.vocabulary import ID_PATTERN

TEXT_PART_TYPES = frozenset({"text"})


class UIPart(BaseModel):
    """One part of a UI message: any ``type``; a text part carries its ``text``."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str = Field(min_length=1, max_length=128)
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> UIPart:
        if self.type in TEXT_PART_TYPES and self.text is None:
            raise ValueError("a text part needs a string `text`")
        return self


class UIMessage(BaseModel):
    """A UI message as ``useChat`` keeps it: an id, a role and parts."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str = Field(min_length=1, max_length=128)
    role: Literal["system", "user", "assistant"]
    parts: list[UIPart]

    @property
    def text(self) -> str:
        return "".join(p.text or "" for p in self.parts if p.type in TEXT_PART_TYPES)


def _content(message: UIMessage, index: int) -> str | list[dict[str, Any]]:
    """A user or system message's content: its text, or with image files, text and image
    parts in their order (the core checks the URLs; a file of another kind is a 400)."""
    files = [(n, p) for n, p in enumerate(message.parts) if p.type == "file"]
    if not files:
        return message.text
    for n, part in files:
        media_type = (part.model_extra or {}).get("mediaType")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise BadRequest(
                f"messages[{index}].parts[{n}]: a file part of media type {str(media_type)[:64]!r} "
                "is not taken here (image files only)",
                code="bad_messages",
            )
        if message.role != "user":
            raise BadRequest(
                f"messages[{index}].parts[{n}]: images are for user messages only",
                code="bad_messages",
            )
    parts: list[dict[str, Any]] = []
    for part in message.parts:
        if part.type in TEXT_PART_TYPES:
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "file":
            parts.append({"type": "image", "url": (part.model_extra or {}).get("url")})
    return parts


class ChatRequest(BaseModel):
    """The body ``DefaultChatTransport`` posts, plus the broker's own fields from ``body``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Checked by turn_request (400 bad_chat_id); the pattern is for the document.
    id: str = Field(
        description="the chat id: the broker's conversation id",
        json_schema_extra={"pattern": ID_PATTERN.pattern},
    )
    messages: list[UIMessage] = Field(min_length=1)
    trigger: Literal["submit-message", "regenerate-message"]
    messageId: str | None = Field(
        default=None, description="the message a regenerate replaces (informational)"
    )
    provider: str | None = Field(
        default=None, max_length=64, json_schema_extra={"x-broker-catalogue": "providers"}
    )
    model: str | None = Field(
        default=None, max_length=256, json_schema_extra={"x-broker-catalogue": "models"}
    )
    params: dict[str, Any] = Field(default_factory=dict)
    session_id: str | None = None
    tools: dict[str, UITool] | None = Field(
        default=None,
        description="extension: the chat's client tools, by name (the AI SDK's `tools` of a "
        "route): the model's calls come out as tool parts, and the client sends their outputs",
    )

    def native_messages(self) -> list[dict[str, Any]]:
        """The chat's messages as the model sees them: text, and client tool calls with their
        results (400 naming a tool part that does not fit)."""
        native: list[dict[str, Any]] = []
        last = len(self.messages) - 1
        for i, message in enumerate(self.messages):
            if message.role == "assistant":
                parts = [p.model_dump() for p in message.parts]
                native += assistant_messages(parts, f"messages[{i}]", last=i == last)
            else:
                native.append({"role": message.role, "content": _content(message, i)})
        return native

    def answered_turn_id(self, native: list[dict[str, Any]]) -> str:
        """The turn this request starts: the last user message's, or, when the assistant's
        message with its tool outputs is last, the follow-up turn that answers them."""
        last = self.messages[-1]
        if last.role == "assistant" and self.trigger == "submit-message":
            if native[-1]["role"] != "tool":
                raise BadRequest(
                    "the last message must be the user's (the one to answer), or the "
                    "assistant's ending with the outputs of its tool calls",
                    code="bad_messages",
                )
            answered = answered_attempt([p.model_dump() for p in last.parts])
            return follow_up_turn_id(self.id, last.id, native, answered)
        return self.turn_id

    def approvals(self) -> tuple[str, list[ApprovalAnswer]] | None:
        """When the last message is the assistant's with tool approvals a person answered
        (``addToolApprovalResponse``): the turn they are of, and the answers; else None."""
        last = self.messages[-1]
        if last.role != "assistant" or self.trigger != "submit-message":
            return None
        parts = [p.model_dump() for p in last.parts]
        answers = approval_answers(parts, f"messages[{len(self.messages) - 1}]")
        if not answers:
            return None
        turn_id = answered_turn(last.id, parts)
        if not ID_PATTERN.fullmatch(turn_id):
            raise BadRequest(
                f"message id {last.id[:80]!r} names no turn whose approvals it answers",
                code="bad_message_id",
            )
        return turn_id, answers

    @property
    def turn_id(self) -> str:
        """The last user message's id, which names the turn."""
        last = self.messages[-1]
        if last.role != "user":
            raise BadRequest(
                "the last message must be the user's (the one to answer)", code="bad_messages"
            )
        if not ID_PATTERN.fullmatch(last.id):
            raise BadRequest(
                f"message id {last.id[:80]!r} is not a usable turn id: "
                "1-128 of A-Z a-z 0-9 . _ : -",
                code="bad_message_id",
            )
        return last.id

    def turn_request(self) -> TurnRequest:
        """The native request for this chat's turn; 400 for what the broker cannot take."""
        if not ID_PATTERN.fullmatch(self.id):
            raise BadRequest(
                f"chat id {self.id[:80]!r} is not a usable conversation id: "
                "1-128 of A-Z a-z 0-9 . _ : -",
                code="bad_chat_id",
            )
        native = self.native_messages()
        turn_id = self.answered_turn_id(native)
        echo: dict[str, Any] | None = None
        if turn_id != self.messages[-1].id:  # a follow-up: its replay shows the steps before it
            parts = [p.model_dump() for p in self.messages[-1].parts]
            echo = {PRELUDE_PARTS: kept_parts(parts)}
            answered = answered_attempt(parts)
            if answered and isinstance(answered[0], str):
                echo[ANSWERS] = answered[0]
        try:
            return TurnRequest(
                conversation_id=self.id,
                turn_id=turn_id,
                messages=[Message.model_validate(m) for m in native],
                provider=self.provider,
                model=self.model,
                params=self.params,
                client_tools=[ClientTool.model_validate(t) for t in client_tools(self.tools)],
                session_id=self.session_id,
                echo=echo,
            )
        except ValidationError as exc:
            raise BadRequest(describe_validation(exc.errors())) from None
