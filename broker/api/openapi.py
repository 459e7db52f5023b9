"""The OpenAPI document (``/openapi.json``) as the broker answers: the components routes
reference by hand, parameters the routes parse themselves, the bounds this app's settings
choose, and the providers and models this broker serves.

The shapes themselves are in :mod:`broker.api.schemas`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from broker.api.schemas import COMPONENTS, REF_TEMPLATE
from broker.settings import Settings

# A request field whose valid values are this broker's providers or models: the document lists
# them (`enum`) once the app runs and knows its providers.
CATALOGUE = "x-broker-catalogue"


def install_components(app: FastAPI, settings: Settings | None = None) -> None:
    """Make ``app``'s OpenAPI document include the components of :func:`json_schema`, and
    say what the broker really does where FastAPI's defaults would not.

    * A parameter a route declares in ``openapi_extra`` replaces the one FastAPI derived from
      its signature (routes parse some parameters themselves, to keep the broker's error codes).
    * FastAPI's "422 Validation Error" is not sent: a request that fails validation gets a 400
      in the broker's error shape. Routes that do answer 422 declare it themselves.
    * The bounds that settings choose are this app's: ``wait`` of a stream read goes up to
      its ``BROKER_LONG_POLL_MAX_S``, ``heartbeat`` between its ``BROKER_SSE_HEARTBEAT_S``
      and ``BROKER_SSE_HEARTBEAT_MAX_S``, ``batch_ms`` up to its ``BROKER_SSE_BATCH_MAX_MS``.
    * A field marked with :data:`CATALOGUE` lists the providers or models this broker serves
      (read from the running app's providers; the document is built on its first request).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in COMPONENTS.items():
                schemas.setdefault(name, schema)
            for operation in _operations(document):
                _settle(operation, settings)
            providers = getattr(getattr(app.state, "runtime", None), "providers", None)
            if providers is not None:
                _list_catalogue(document, catalogue(providers))
            if not _refers_to(document["paths"], "HTTPValidationError"):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _operations(document: dict[str, Any]) -> list[dict[str, Any]]:
    methods = ("get", "put", "post", "delete", "patch", "head", "options")
    paths = document.get("paths", {}).values()
    return [op for path in paths for method, op in path.items() if method in methods]


def _settle(operation: dict[str, Any], settings: Settings | None) -> None:
    """One operation as the broker answers it (see :func:`install_components`)."""
    parameters: dict[tuple[str, str], dict[str, Any]] = {}
    for parameter in operation.get("parameters", []):
        key = (str(parameter["name"]).lower(), str(parameter["in"]))
        parameters.pop(key, None)  # a later declaration (openapi_extra's) wins, in its place
        parameters[key] = parameter
    if parameters:
        operation["parameters"] = list(parameters.values())
    wait = parameters.get(("wait", "query"))
    if wait is not None and settings is not None:
        wait["schema"]["maximum"] = int(settings.long_poll_max_s)
    heartbeat = parameters.get(("heartbeat", "query"))
    if heartbeat is not None and settings is not None:
        heartbeat["schema"]["minimum"] = math.ceil(settings.sse_heartbeat_s)
        heartbeat["schema"]["maximum"] = int(settings.sse_heartbeat_max_s)
    batch = parameters.get(("batch_ms", "query"))
    if batch is not None and settings is not None:
        batch["schema"]["maximum"] = settings.sse_batch_max_ms
    responses = operation.get("responses", {})
    if _refers_to(responses.get("422", {}), "HTTPValidationError"):
        del responses["422"]


class _ProviderModels:
    """What :func:`catalogue` reads of a provider (``broker.providers.base.Provider``)."""

    name: str
    models: tuple[str, ...]


def catalogue(providers: Iterable[Any]) -> dict[str, list[str] | None]:
    """The values of each :data:`CATALOGUE` kind; None when a provider takes any model name.

    ``openai-models`` is what the OpenAI dialect's ``model`` takes: a model, a provider's name,
    or ``provider/model``.
    """
    served: list[_ProviderModels] = list(providers)
    names = [p.name for p in served]
    if any(not p.models for p in served):
        return {"providers": names, "models": None, "openai-models": None}
    models = list(dict.fromkeys(m for p in served for m in p.models))
    paths = [f"{p.name}/{m}" for p in served for m in p.models]
    openai = list(dict.fromkeys([*models, *names, *paths]))
    return {"providers": names, "models": models, "openai-models": openai}


def _list_catalogue(node: Any, values: dict[str, list[str] | None]) -> None:
    """Give every schema marked with :data:`CATALOGUE` under ``node`` its ``enum``."""
    if isinstance(node, list):
        for item in node:
            _list_catalogue(item, values)
        return
    if not isinstance(node, dict):
        return
    kind = node.pop(CATALOGUE, None)
    listed = values.get(kind) if isinstance(kind, str) else None
    if listed is not None:
        nullable = any(branch.get("type") == "null" for branch in node.get("anyOf", []))
        node["enum"] = [*listed, None] if nullable else listed
    for value in node.values():
        _list_catalogue(value, values)


def _refers_to(node: Any, name: str) -> bool:
    """Whether ``node`` holds a ``$ref`` to the component ``name``."""
    if isinstance(node, dict):
        if node.get("$ref") == REF_TEMPLATE.format(model=name):
            return True
        return any(_refers_to(value, name) for value in node.values())
    if isinstance(node, list):
        return any(_refers_to(value, name) for value in node)
    return False
