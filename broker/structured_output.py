"""Structured output: the turn's ``response_format`` and the check its answer must pass.

A turn asks for one of three forms of answer:

* ``"text"``: anything (the default);
* ``"json"``: one JSON document;
* ``{"type": "json_schema", "name": ..., "schema": {...}, "strict": ..., "description": ...}``:
  one JSON document that validates against ``schema`` (a JSON Schema, checked against its
  meta-schema when the turn is created).

The answer is checked once, when the attempt's output has ended and before it can become
canonical (:func:`output_problem`); a failed check fails the attempt with ``invalid_output``.
``continue`` is refused for both JSON forms (broker/lua/start_attempt.lua): a prefilled JSON
document is not one the model wrote whole, so a cut JSON answer is regenerated instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import orjson
from jsonschema import exceptions as schema_errors
from jsonschema import validators
from pydantic import BaseModel, ConfigDict, Field, field_validator
from referencing.exceptions import Unresolvable

# OpenAI's rule for a format's name; the broker keeps it so that every door can pass it on.
FORMAT_NAME_REGEX = r"^[A-Za-z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    """``response_format``'s JSON Schema form."""

    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=FORMAT_NAME_REGEX)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = Field(default=None, max_length=4096)

    @field_validator("schema_")
    @classmethod
    def _a_json_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        problem = schema_problem(schema)
        if problem is not None:
            raise ValueError(problem)
        return schema


ResponseFormat = Literal["text", "json"] | JsonSchemaFormat


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a JSON Schema (its own meta-schema decides), or None.

    A ``$ref`` must point into the schema itself (``#...``): the broker fetches nothing.
    """
    if not isinstance(schema.get("$schema", ""), str):
        return "schema is not a valid JSON Schema: $schema must be a string"
    try:
        validators.validator_for(schema).check_schema(schema)
    except schema_errors.SchemaError as exc:
        return f"schema is not a valid JSON Schema: {exc.message} (at {_path(exc.path)})"
    remote = next(_remote_refs(schema), None)
    if remote is not None:
        return f"schema: $ref {remote[:128]!r} is not supported (only refs within the schema, #...)"
    return None


def _remote_refs(value: Any) -> Iterator[str]:
    """Every ``$ref`` (and ``$dynamicRef``) of ``value`` that leaves the document."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("$ref", "$dynamicRef") and not (isinstance(item, str) and item[:1] == "#"):
                yield str(item)
            else:
                yield from _remote_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _remote_refs(item)


def format_kind(response_format: Any) -> str:
    """``text``, ``json`` or ``json_schema``: what the turn's hash keeps (the Lua reads it)."""
    if isinstance(response_format, JsonSchemaFormat):
        return "json_schema"
    if isinstance(response_format, dict):
        return str(response_format.get("type", "text"))
    return str(response_format)


def output_problem(response_format: Any, text: str) -> str | None:
    """Why ``text`` is not the answer ``response_format`` asks for, or None when it is.

    ``response_format`` is the stored request's value: a string or the JSON Schema form as a
    dict.
    """
    kind = format_kind(response_format)
    if kind == "text":
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"the answer is not valid JSON: {exc}"
    if kind != "json_schema":
        return None
    schema = response_format["schema"]
    validator = validators.validator_for(schema)(schema)
    try:
        error = schema_errors.best_match(validator.iter_errors(value))
    except (Unresolvable, RecursionError) as exc:
        # A ref into the schema that points nowhere: the schema, not the answer, is at fault.
        return f"the schema {response_format.get('name', '')!r} could not be applied: {exc}"
    if error is None:
        return None
    name = response_format.get("name", "")
    return (
        f"the answer does not match the schema {name!r} at {_path(error.absolute_path)}: "
        f"{error.message}"
    )


def _path(path: Any) -> str:
    """A JSON path for a validation error's location (``$`` is the document itself)."""
    text = "$"
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def chat_response_format(response_format: Any) -> dict[str, Any] | None:
    """The Chat Completions ``response_format`` for the turn's (None: plain text)."""
    kind = format_kind(response_format)
    if kind == "json":
        return {"type": "json_object"}
    if kind != "json_schema":
        return None
    spec = {key: response_format[key] for key in ("name", "schema")}
    for key in ("strict", "description"):
        if response_format.get(key) is not None:
            spec[key] = response_format[key]
    return {"type": "json_schema", "json_schema": spec}


def schema_instruction(response_format: Any) -> str:
    """A system-prompt sentence that carries the schema, for upstreams without a JSON mode."""
    if format_kind(response_format) != "json_schema":
        return ""
    schema = orjson.dumps(response_format["schema"], option=orjson.OPT_SORT_KEYS).decode()
    about = f" ({response_format['description']})" if response_format.get("description") else ""
    return (
        f" The value must validate against this JSON Schema, named {response_format['name']}"
        f"{about}: {schema}"
    )
