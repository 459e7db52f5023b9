"""OpenAI's published contract, for the tests of the OpenAI doors.

Two checks of every object and event the doors produce:

* :func:`spec_errors`: against OpenAI's OpenAPI document (vendored in ``tests/schemas/openai/``,
  see its README for the version), by JSON Schema (the document is OpenAPI 3.1, whose schemas
  are JSON Schema 2020-12; its ``$ref``s resolve inside the document). A streamed Responses
  event is checked against the member of ``ResponseStreamEvent`` for its ``type``. Some schemas
  of the document still say ``nullable: true`` (OpenAPI 3.0's word, which JSON Schema ignores):
  the loader reads it as OpenAI's SDKs do, a value that may also be ``null``.
* :func:`sdk_extras`: against the official Python SDK's typed models, strictly: validated, then
  every field the model does not declare is listed (the SDK keeps them silently).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from pydantic import BaseModel
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).parent / "schemas" / "openai" / "openapi.yaml"
BASE = "urn:openai:openapi"


@functools.cache
def spec() -> dict[str, Any]:
    """The vendored OpenAPI document, parsed once per process."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with SPEC_PATH.open(encoding="utf-8") as file:
        document: dict[str, Any] = yaml.load(file, Loader=loader)
    result: dict[str, Any] = _nullable(document)
    return result


def _nullable(node: Any) -> Any:
    """``node`` with each ``nullable: true`` schema as ``anyOf: [schema, null]``."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _registry() -> Registry[Any]:
    resource: Resource[Any] = Resource.from_contents(spec(), default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(BASE, resource)
    return registry


@functools.cache
def validator(component: str) -> Draft202012Validator:
    """A validator for ``#/components/schemas/<component>``."""
    if component not in spec()["components"]["schemas"]:
        raise KeyError(f"no component {component!r} in the vendored OpenAPI document")
    schema = {"$ref": f"{BASE}#/components/schemas/{component}"}
    return Draft202012Validator(schema, registry=_registry())


def _ref_name(ref: str) -> str:
    return ref.rpartition("/")[2]


@functools.cache
def stream_event_components() -> dict[str, str]:
    """Each Responses event type as the component of ``ResponseStreamEvent`` that defines it."""
    schemas = spec()["components"]["schemas"]
    table: dict[str, str] = {}
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = _ref_name(member["$ref"])
        for kind in schemas[name]["properties"]["type"].get("enum", ()):
            table[kind] = name
    return table


def spec_errors(component: str, instance: Any) -> list[str]:
    """Where ``instance`` breaks ``component`` of the spec (empty: it conforms)."""
    found = sorted(validator(component).iter_errors(instance), key=lambda e: list(e.path))
    return [f"{component} at {'/'.join(map(str, e.path)) or '.'}: {e.message[:300]}" for e in found]


def event_errors(event: dict[str, Any]) -> list[str]:
    """Where a streamed Responses event breaks its own member of ``ResponseStreamEvent``."""
    component = stream_event_components().get(str(event.get("type")))
    if component is None:
        return [f"event type {event.get('type')!r} is no member of ResponseStreamEvent"]
    return spec_errors(component, event)


def sdk_extras(model: BaseModel, path: str = "") -> list[str]:
    """The fields of ``model`` (recursively) that its SDK type does not declare."""
    extras = [f"{path}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        extras += _extras_in(getattr(model, name), f"{path}{name}.")
    return extras


def _extras_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return sdk_extras(value, path)
    if isinstance(value, list):
        return [e for n, v in enumerate(value) for e in _extras_in(v, f"{path}{n}.")]
    return []
