"""The request bodies of the OpenAI dialect, and their translation to a :class:`TurnRequest`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.errors import BadRequest
from broker.providers import Providers
from broker.turns import WHOLE, WholeNumber
from broker.vocabulary import ID_PATTERN

ID_REGEX = ID_PATTERN.pattern


class ParamError(BadRequest):
    """A 400 that names the request parameter at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.param = param


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(BaseModel):
    """One message of ``input``, with string or text-part content."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = Field(default=None, max_length=256)
    status: str | None = Field(default=None, max_length=32)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class BrokerExtension(BaseModel):
    """The ``broker`` extension field: the native ``params`` (e.g. ``simulate``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    params: dict[str, Any] = Field(default_factory=dict)


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: the subset people send, plus ``broker``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        min_length=1, max_length=256, json_schema_extra={"x-broker-catalogue": "openai-models"}
    )
    input: str | list[InputMessage]
    instructions: str | None = None
    stream: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000), WHOLE] | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool | None = None
    broker: BrokerExtension | None = Field(
        default=None, description="extension: native turn params, such as params.simulate"
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(default=None, max_length=128)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``: the subset people send, plus ``broker``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        min_length=1, max_length=256, json_schema_extra={"x-broker-catalogue": "openai-models"}
    )
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: Annotated[int, Field(ge=1, le=10_000_000), WHOLE] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=10_000_000), WHOLE] | None = None
    stop: str | list[str] | None = None
    seed: WholeNumber | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    n: Annotated[int, Field(ge=1, le=1), WHOLE] | None = None
    user: str | None = Field(default=None, max_length=256)
    broker: BrokerExtension | None = None


def check_known(payload: dict[str, Any], model: type[BaseModel]) -> None:
    """400 naming the first parameter the dialect does not take."""
    unknown = sorted(set(payload) - set(model.model_fields))
    if unknown:
        raise ParamError(
            f"unsupported parameter: {unknown[0]!r} (this broker takes: "
            f"{', '.join(sorted(model.model_fields))})",
            unknown[0],
            code="unknown_parameter",
        )


def resolve_model(providers: Providers, model: str) -> tuple[str | None, str | None]:
    """``model`` as (provider, model): ``provider/model``, a model some provider serves, or a
    provider's name; anything else goes to the default provider, which may refuse it."""
    prefix, slash, rest = model.partition("/")
    # Any provider's name, served or not: one not served here is a 400 that says so.
    if slash and prefix in providers.known:
        return prefix, rest
    for provider in providers:
        if model in provider.models:
            return provider.name, model
    if model in providers.known:
        return model, None
    return None, model


def turn_params(
    extension: BrokerExtension | None,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
) -> dict[str, Any]:
    params = dict(extension.params) if extension is not None else {}
    for name, value in (("temperature", temperature), ("top_p", top_p), ("max_tokens", max_tokens)):
        if value is not None:
            params[name] = value
    return params


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as the native role/content messages."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for message in request.input:
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": message.text()})
    if not any(m["role"] != "system" for m in messages):
        raise ParamError("input must hold at least one message", "input", code="empty_input")
    return messages


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in request.messages:
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
