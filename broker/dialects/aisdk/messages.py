"""The AI SDK's chat request, and its translation to a broker :class:`TurnRequest`.

The chat id is the conversation id and the id of the last user message, minted by the client,
is the turn id: the same message sent twice (two tabs, a double click) is one turn. Only text
parts reach the model; other parts (files, tool parts, data parts) of the history are skipped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.api.errors import describe_validation
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
        try:
            return TurnRequest(
                conversation_id=self.id,
                turn_id=self.turn_id,
                messages=[Message(role=m.role, content=m.text) for m in self.messages],
                provider=self.provider,
                model=self.model,
                params=self.params,
                session_id=self.session_id,
            )
        except ValidationError as exc:
            raise BadRequest(describe_validation(exc.errors())) from None
