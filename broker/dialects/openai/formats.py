"""Structured output at the OpenAI doors: ``text.format`` and ``response_format``, as the native
``response_format`` (see broker/structured_output.py).

* ``{"type": "text"}`` (both doors) is ``"text"``;
* ``{"type": "json_object"}`` (both doors) is ``"json"``;
* Responses ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}`` and Chat
  Completions ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
  "description"?}}`` are ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}``.

Anything else (another type, a missing name, a schema its meta-schema refuses, an unknown key) is
a 400 naming the parameter. Pure: tested as a table (tests/test_openai_formats.py).
"""

from __future__ import annotations

import re
from typing import Any

from broker.dialects.openai.requests import ParamError
from broker.structured_output import FORMAT_NAME_REGEX, schema_problem

TYPES = ("text", "json_object", "json_schema")
SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def responses_format(text: dict[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
    """Responses ``text`` as (the native format, what the response object's ``text`` echoes:
    None when the request sent no format)."""
    if text is None:
        return "text", None
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise ParamError(
            f"text.{unknown[0]} is not supported (this broker takes: text.format)",
            "text",
            code="unsupported_parameter",
        )
    fmt = text.get("format")
    if fmt is None:
        return "text", None
    if not isinstance(fmt, dict):
        raise ParamError("text.format must be an object", "text.format")
    kind = _kind(fmt, "text.format")
    if kind != "json_schema":
        _only(fmt, {"type"}, "text.format")
        return _NATIVE[kind], {"format": {"type": kind}}
    spec = {k: v for k, v in fmt.items() if k != "type"}
    native = _schema_form(spec, "text.format")
    return native, {"format": {"type": "json_schema", **spec}}


def chat_format(response_format: dict[str, Any] | None) -> Any:
    """Chat Completions ``response_format`` as the native format."""
    if response_format is None:
        return "text"
    kind = _kind(response_format, "response_format")
    if kind != "json_schema":
        _only(response_format, {"type"}, "response_format")
        return _NATIVE[kind]
    _only(response_format, {"type", "json_schema"}, "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ParamError("response_format.json_schema must be an object", "response_format")
    return _schema_form(spec, "response_format.json_schema")


_NATIVE = {"text": "text", "json_object": "json"}


def _kind(fmt: dict[str, Any], where: str) -> str:
    kind = fmt.get("type")
    if kind not in TYPES:
        raise ParamError(
            f"{where}.type must be one of {', '.join(TYPES)}, not {str(kind)[:64]!r}",
            _param(where),
            code="unsupported_parameter",
        )
    return str(kind)


def _only(fmt: dict[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(fmt) - keys)
    if unknown:
        raise ParamError(
            f"{where}.{unknown[0]} is not supported for type {fmt.get('type')!r}",
            _param(where),
            code="unsupported_parameter",
        )


def _schema_form(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """``spec`` (name, schema, strict?, description?) as the native ``json_schema`` form."""
    param = _param(where)
    unknown = sorted(set(spec) - SCHEMA_KEYS)
    if unknown:
        raise ParamError(f"{where}.{unknown[0]} is not supported", param)
    name, schema = spec.get("name"), spec.get("schema")
    if not isinstance(name, str) or not _good_name(name):
        raise ParamError(f"{where}.name must be 1-64 letters, digits, _ and -", param)
    if not isinstance(schema, dict):
        raise ParamError(f"{where}.schema must be a JSON Schema object", param)
    problem = schema_problem(schema)
    if problem is not None:
        raise ParamError(f"{where}.{problem}", param)
    native: dict[str, Any] = {"type": "json_schema", "name": name, "schema": schema}
    for key, kind in (("strict", bool), ("description", str)):
        value = spec.get(key)
        if value is not None and not isinstance(value, kind):
            raise ParamError(f"{where}.{key} must be a {kind.__name__}", param)
        if value is not None:
            native[key] = value
    return native


def _good_name(name: str) -> bool:
    return re.fullmatch(FORMAT_NAME_REGEX, name) is not None


def _param(where: str) -> str:
    return "response_format" if where.startswith("response_format") else "text.format"
