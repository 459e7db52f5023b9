"""The request bodies of the OpenAI dialect, and their translation to a :class:`TurnRequest`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.content import Detail, parse_image_url
from broker.dialects.openai.tools import (
    ChatTool,
    ChatToolCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesTool,
    native_calls,
)
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


# The labels pydantic puts in an error's location for the branch of a union it tried.
_BRANCH_LABELS: Final = frozenset({"str", "int", "float", "bool"})


def _place(loc: tuple[int | str, ...]) -> list[int | str]:
    return [p for p in loc if not (isinstance(p, str) and (p in _BRANCH_LABELS or "[" in p))]


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """A validation error as one clear sentence and the parameter at fault: the deepest place
    that failed (the branch of a union the value was meant for), without pydantic's branch
    labels; the failures of every branch at one place are given together."""
    errors = exc.errors()
    deepest = max(errors, key=lambda e: len(_place(e["loc"])))
    place = _place(deepest["loc"])
    messages = dict.fromkeys(e["msg"] for e in errors if _place(e["loc"]) == place)
    where = ".".join(str(p) for p in place) or "body"
    return f"{where}: {' or '.join(messages)}", (str(place[0]) if place else None)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    # An ``output_text`` part of an earlier response sent back (the Agents SDK does): its
    # logprobs say nothing to the model, which is given the text.
    logprobs: list[Any] | None = None


class InputImage(BaseModel):
    """A Responses ``input_image`` content part: ``image_url`` a URL or a data URL (there is no
    files API here, so ``file_id`` is refused by :func:`input_items`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Detail | None = None


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str
    detail: Detail | None = None


class ChatImagePart(BaseModel):
    """A Chat Completions ``image_url`` content part."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["image_url"]
    image_url: ImageURL


ResponsesPart = Annotated[ContentPart | InputImage, Field(discriminator="type")]
ChatPart = Annotated[ContentPart | ChatImagePart, Field(discriminator="type")]


def image_part(where: str, param: str, url: str | None, detail: str | None) -> dict[str, Any]:
    """An image part of a door as the native one (see broker.content); 400 naming ``param``
    when its URL is not one the broker takes."""
    if url is None:
        raise ParamError(f"{where}: an image URL is required", param, code="invalid_image")
    try:
        parse_image_url(url)
    except ValueError as exc:
        raise ParamError(f"{where}: {exc}", param, code="invalid_image") from None
    part = {"type": "image", "url": url}
    if detail is not None:
        part["detail"] = detail
    return part


def native_content(
    role: str, parts: list[Any], images: dict[int, dict[str, Any]], where: str, param: str
) -> str | list[dict[str, Any]]:
    """A door message's parts as native content: the text joined, as it always was, or, when
    it holds ``images`` (native image parts by index), text and image parts in order."""
    if not images:
        return "".join(part.text for part in parts)
    if role != "user":
        raise ParamError(f"{where}: images are for user messages only", param, code="invalid_image")
    out = []
    for n, part in enumerate(parts):
        image = images.get(n)
        out.append(image if image is not None else {"type": "text", "text": part.text})
    return out


class ItemReference(BaseModel):
    """An ``item_reference`` input item: an output item of this broker's, by its id."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["item_reference"]
    id: str = Field(min_length=1, max_length=256)


class InputMessage(BaseModel):
    """One message of ``input``, with string or text-part content."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponsesPart]
    id: str | None = Field(default=None, max_length=256)
    status: str | None = Field(default=None, max_length=32)

    def native(self, n: int) -> str | list[dict[str, Any]]:
        """Its content as native content; 400 naming ``input`` for a bad image."""
        if isinstance(self.content, str):
            return self.content
        where = f"input[{n}] (message item)"
        images = {}
        for i, part in enumerate(self.content):
            if isinstance(part, InputImage):
                if part.file_id is not None:
                    raise ParamError(
                        f"{where} content[{i}]: input_image file_id is not supported (there "
                        "is no files API here): send image_url, a URL or a data URL",
                        "input",
                        code="unsupported_content",
                    )
                at = f"{where} content[{i}] (input_image)"
                images[i] = image_part(at, "input", part.image_url, part.detail)
        return native_content(self.role, self.content, images, where, "input")


class BrokerExtension(BaseModel):
    """The ``broker`` extension field: the native ``params`` (e.g. ``simulate``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    params: dict[str, Any] = Field(default_factory=dict)


# ``include`` values that change nothing here: they ask for more of output items the broker never
# produces (its Responses output is messages of text) or of input it does not echo (the response
# object does not list its input, images included). Any other
# value (``message.output_text.logprobs``: logprobs the broker does not have) is a 400.
INCLUDE_NOTHING: Final = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: the subset people send, plus ``broker``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        min_length=1, max_length=256, json_schema_extra={"x-broker-catalogue": "openai-models"}
    )
    # Items are checked one by one (:func:`input_items`), so a refusal names the item's type.
    input: str | list[dict[str, Any]] = Field(
        description=(
            "a string, or items: messages (role, content), item_reference, function_call, "
            "function_call_output; or mcp_approval_response items alone"
        )
    )
    instructions: str | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    # function tools (broker.dialects.openai.tools): each checked by its type (responses_tools)
    tools: list[dict[str, Any]] | None = Field(default=None, description="functions only")
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Checked by broker.dialects.openai.formats, so that a refusal names text.format.
    text: dict[str, Any] | None = Field(
        default=None, description="format only: text, json_object or json_schema"
    )
    # The broker never truncates a conversation to fit: "disabled" (the default) is what it does.
    truncation: Literal["disabled"] | None = None
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

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only beside tool_calls (an assistant message that only called tools)
    content: str | list[ChatPart] | None = None
    name: str | None = Field(default=None, max_length=128)
    # function tools: an assistant message's calls, a tool message's answer to one
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128)

    def native(self, i: int) -> str | list[dict[str, Any]]:
        """Its content as native content; 400 naming ``messages`` for a bad image."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        images = {
            n: image_part(
                f"messages[{i}].content[{n}].image_url",
                "messages",
                part.image_url.url,
                part.image_url.detail,
            )
            for n, part in enumerate(self.content)
            if isinstance(part, ChatImagePart)
        }
        return native_content(self.role, self.content, images, f"messages[{i}]", "messages")


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
    # Checked by broker.dialects.openai.formats: text, json_object or json_schema.
    response_format: dict[str, Any] | None = None
    # function tools (broker.dialects.openai.tools); at most MAX_CLIENT_TOOLS, checked by the
    # core (a bound in the schema would have a schema fuzzer send bodies past the body limit)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
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


def check_supported(request: ResponsesRequest) -> list[ResponsesTool]:
    """The request's function tools; 400 naming ``tools`` or ``include`` for what the broker
    cannot honour; empty lists and ``include`` values that change nothing here are taken as if
    absent."""
    check_include(request.include or ())
    return responses_tools(request.tools or [])


def responses_tools(tools: list[dict[str, Any]]) -> list[ResponsesTool]:
    """``tools`` as function tools; 400 naming ``tools`` for another type or a bad field."""
    out = []
    for n, raw in enumerate(tools):
        if raw.get("type") != "function":
            raise ParamError(
                f"tools[{n}]: tools of type {str(raw.get('type'))[:64]!r} are not supported "
                "(this broker takes: function)",
                "tools",
                code="unsupported_parameter",
            )
        try:
            out.append(ResponsesTool.model_validate(raw))
        except ValidationError as exc:
            message, _ = describe(exc)
            raise ParamError(f"tools[{n}] {message}", "tools") from None
    return out


def tool_params(
    tool_choice: Any, parallel_tool_calls: bool | None, names: list[str]
) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` as the turn's params (see
    :data:`broker.client_tools.TOOL_PARAMS`; ``auto`` is the default and ``none`` offers no
    tools, so neither is a param); 400 naming ``tool_choice`` for a choice of another type, a
    function that is not among ``names`` (the request's tools), or ``required`` without tools."""
    params: dict[str, Any] = {}
    if parallel_tool_calls is False:
        params["parallel_tool_calls"] = False
    if tool_choice is None or tool_choice in ("auto", "none"):
        return params
    if tool_choice == "required":
        if not names:
            raise ParamError("tool_choice 'required' needs tools to call", "tool_choice")
        return params | {"tool_choice": "required"}
    name = _named(tool_choice)
    if name is None:
        raise ParamError(
            f"tool_choice of type {str(tool_choice.get('type'))[:64]!r} is not supported (this "
            "broker takes: auto, none, required, and a function by name)",
            "tool_choice",
            code="unsupported_parameter",
        )
    if name not in names:
        raise ParamError(
            f"tool_choice names the function {name[:128]!r}, which is not among tools",
            "tool_choice",
        )
    return params | {"tool_choice": {"name": name}}


def _named(choice: dict[str, Any]) -> str | None:
    """The function a ``tool_choice`` object names: Responses' ``{type, name}`` or Chat
    Completions' ``{type, function: {name}}``; None for any other shape."""
    if choice.get("type") != "function":
        return None
    if set(choice) == {"type", "name"}:
        name = choice["name"]
    elif set(choice) == {"type", "function"} and isinstance(choice["function"], dict):
        name = choice["function"].get("name") if set(choice["function"]) == {"name"} else None
    else:
        return None
    return name if isinstance(name, str) else None


def check_include(values: Iterable[str]) -> None:
    """400 naming ``include`` for a value that would change the response (see
    :data:`INCLUDE_NOTHING`)."""
    for value in values:
        if value not in INCLUDE_NOTHING:
            raise ParamError(
                f"include value {value!r} is not supported (this broker takes: "
                f"{', '.join(sorted(INCLUDE_NOTHING))})",
                "include",
                code="unsupported_parameter",
            )


InputItem = InputMessage | ItemReference | FunctionCallItem | FunctionCallOutputItem
ITEM_MODELS: Final[dict[str | None, type[InputItem]]] = {
    None: InputMessage,
    "message": InputMessage,
    "item_reference": ItemReference,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def input_items(request: ResponsesRequest) -> list[InputItem]:
    """``input`` as typed items; 400 naming ``input`` and the item (and its type) at fault."""
    if isinstance(request.input, str):
        return [InputMessage(role="user", content=request.input)]
    items: list[InputItem] = []
    for n, raw in enumerate(request.input):
        kind = raw.get("type")
        model = ITEM_MODELS.get(kind) if kind is None or isinstance(kind, str) else None
        if model is None:
            raise ParamError(
                f"input[{n}]: items of type {str(kind)[:64]!r} are not supported "
                "(this broker takes: message, item_reference, function_call, "
                "function_call_output)",
                "input",
                code="unsupported_input_item",
            )
        if model is InputMessage:
            _check_parts(n, raw.get("content"))
        try:
            items.append(model.model_validate(raw))
        except ValidationError as exc:
            message, _ = describe(exc)
            raise ParamError(f"input[{n}] ({kind or 'message'} item) {message}", "input") from None
    return items


PART_TYPES: Final = ("input_text", "output_text", "text", "input_image")


def _check_parts(n: int, content: Any) -> None:
    """400 naming ``input`` and the type of a content part the broker does not take."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in PART_TYPES:
            raise ParamError(
                f"input[{n}] (message item): content parts of type {kind[:64]!r} are not "
                f"supported (this broker takes: {', '.join(PART_TYPES)})",
                "input",
                code="unsupported_content",
            )


def as_message(message: InputMessage, n: int = 0) -> dict[str, Any]:
    """One input message (``input[n]``) as the native role/content message."""
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": message.native(n)}


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise ParamError(
                f"messages[{i}].content is required (null only beside an assistant's tool_calls)",
                "messages",
            )
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": message.native(i)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:  # an empty list is as if absent
            entry["tool_calls"] = native_calls(message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out
