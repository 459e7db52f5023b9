"""The request bodies of the native turn routes (``POST /v1/turns`` and the turn's attempts
and canonical choice), and the integer kinds every door's request models use."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from broker.client_tools import ClientTool, ToolCallPart
from broker.content import Content, check_parts, stored
from broker.structured_output import ResponseFormat
from broker.vocabulary import ID_PATTERN
from broker.webhooks import NotifyRequest

ID_REGEX = ID_PATTERN.pattern


def _whole(value: Any) -> Any:
    """``60.0`` as ``60``: JSON has one kind of number, and JSON Schema's ``integer`` is any
    number without a fraction. Fractions, booleans and strings pass unchanged, for the strict
    integer check to refuse."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# An integer of a request body (the request models are strict: `true` and `"5"` are not one).
# Bounds go before it, `Annotated[int, Field(ge=1), WHOLE]`: after it, pydantic's JSON schema
# spells them `ge`/`le`, which JSON Schema does not know.
WHOLE = BeforeValidator(_whole)
# Any other integer of a body is one every JSON parser reads exactly (JavaScript's safe
# integers): past 64 bits (a float such as 1e300 is a whole number too) it cannot be stored and
# was a 500, and past 2**53 the body's parser rounds it, so that a value just past a 64-bit
# bound came in as the bound itself and was taken.
SAFE_INTEGER: Final = 2**53 - 1
WholeNumber = Annotated[int, Field(ge=-SAFE_INTEGER, le=SAFE_INTEGER), WHOLE]


class Message(BaseModel):
    """One message of the conversation as the model should see it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    # A string, or (user messages) text and image parts: see broker.content.
    content: Content = Field(
        description="a string, or for a user message a list of text and image parts"
    )
    name: str | None = Field(default=None, max_length=128)
    # Set on assistant messages of the conversation history whose answer was cut short; it lets
    # a client send the history back as it got it. Providers never see it.
    partial: bool | None = None
    # An assistant message's calls of client tools, and a tool message's answer to one of them.
    tool_calls: list[ToolCallPart] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _parts(self) -> Message:
        check_parts(self.role, self.content)
        return self


# Message fields that are left out of the stored request (and its fingerprint) when unset.
OPTIONAL_MESSAGE_FIELDS: Final = ("partial", "tool_calls", "tool_call_id")


class TurnRequest(BaseModel):
    """The body of ``POST /v1/turns``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    conversation_id: str = Field(pattern=ID_REGEX)
    turn_id: str | None = Field(default=None, pattern=ID_REGEX)
    messages: list[Message] = Field(min_length=1)
    # The document lists this broker's providers and models (see broker.api.schemas).
    provider: str | None = Field(
        default=None, max_length=64, json_schema_extra={"x-broker-catalogue": "providers"}
    )
    model: str | None = Field(
        default=None, max_length=256, json_schema_extra={"x-broker-catalogue": "models"}
    )
    params: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    # At most MAX_CLIENT_TOOLS, checked with the names (a bound in the schema would have a
    # schema fuzzer send bodies past BROKER_MAX_BODY_BYTES).
    client_tools: list[ClientTool] = Field(default_factory=list)
    response_format: ResponseFormat = "text"
    session_id: str | None = Field(default=None, pattern=ID_REGEX)
    # Where to POST once each attempt is at rest; delivery, not the work: not fingerprinted.
    notify: NotifyRequest | None = None
    # What a door hands back as the client sent it (OpenAI: instructions, metadata, background):
    # stored with the request, never sent upstream.
    echo: dict[str, Any] | None = Field(
        default=None, description="extension: fields a door echoes in its objects"
    )


def stored_request(request: TurnRequest, provider: str) -> dict[str, Any]:
    """The request as the turn stores and fingerprints it: what was sent, with ``provider``
    resolved. Unset optional fields are left out, so that a request without them (a plain
    message, a turn without client tools) stores and fingerprints what it always did."""
    # The session names a retry budget, not the work: it is not part of the fingerprint.
    body = request.model_dump(exclude={"turn_id", "session_id", "notify"})
    for message in body["messages"]:
        message["content"] = stored(message["content"])
        for field in OPTIONAL_MESSAGE_FIELDS:
            if message.get(field) is None:
                message.pop(field, None)
    if not body["client_tools"]:
        body.pop("client_tools")
    if body.get("echo") is None:
        body.pop("echo", None)
    body["provider"] = provider
    return body


class AttemptRequest(BaseModel):
    """The body of ``POST /v1/turns/{turn_id}/attempts``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    strategy: Literal["continue", "regenerate"]


class CanonicalRequest(BaseModel):
    """The body of ``POST /v1/turns/{turn_id}/canonical``: promote an attempt, by CAS."""

    model_config = ConfigDict(extra="forbid", strict=True)

    attempt: Annotated[int, Field(ge=1), WHOLE]
    expected: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        default=None, description="the canonical attempt the client saw (null: none)"
    )
