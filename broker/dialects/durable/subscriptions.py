"""The Durable Streams subscription routes: ``/ds/v1/stream/__ds/subscriptions/{id}`` and the
broker's wake-signing keys at ``/ds/v1/stream/__ds/jwks.json``.

A subscription is created (PUT: 201, or 200 for the same one again), read (GET) and deleted
(DELETE) by its tenant; its explicit streams are added (POST ``/streams``) and removed (DELETE
``/streams/{path}``). A pull-wake worker claims a wake (POST ``/claim``: 200 with the wake and
its token, 204 when nothing is pending, 409 ``ALREADY_CLAIMED`` naming the holder), and acks
(POST ``/ack``) or releases it (POST ``/release``); a webhook receiver calls back (POST
``/callback``). An ack, a callback and a release are authorized by the wake's token
(``Authorization: Bearer``) alone, their tenant named by ``?tenant=`` (the URLs the broker gives
out carry it); one of a wake that is not the live one is refused with 409 ``FENCED``.
These routes parse, call the service (:class:`broker.durable_store.Subscriptions`) and render.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from broker.dialects.durable.routes import PREFIX, _writer
from broker.durable_store import (
    AlreadyClaimed,
    Subscription,
    Subscriptions,
    Wake,
    checked_id,
    checked_url,
    parse_config,
    stream_list,
)
from broker.durable_store.protocol import cursor_of, offset_of
from broker.errors import BadRequest, Unauthorized
from broker.http import Caller, services

RESERVED: Final = PREFIX + "/__ds"
SUBS: Final = RESERVED + "/subscriptions/{sub_id}"
JWKS_TYPE: Final = "application/jwk-set+json"

router = APIRouter(tags=["Durable Streams"], include_in_schema=False)


def _subs(request: Request) -> Subscriptions:
    return services(request).subscriptions


def _json(body: Any, status: int = 200, media_type: str = "application/json") -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=media_type)


def _base(request: Request) -> str:
    """The URL the protocol is mounted at (``.../ds``): what comes before ``/v1/stream/__ds``."""
    url = request.url
    path = url.path
    mount = path[: path.index("/v1/stream/__ds")] if "/v1/stream/__ds" in path else "/ds"
    return f"{url.scheme}://{url.netloc}{mount}"


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not JSON", code="bad_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="bad_json")
    return body


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", code="bad_request")


async def view(subs: Subscriptions, sub: Subscription) -> dict[str, Any]:
    config = sub.config
    shown: dict[str, Any] = {"id": sub.id, "type": config.kind}
    if config.pattern is not None:
        shown["pattern"] = config.pattern
    shown["streams"] = [s.json() for s in sub.streams]
    if config.webhook_url is not None:
        signer = await subs.signer()
        shown["webhook"] = {
            "url": config.webhook_url,
            "signing": {
                "alg": "ed25519",
                "kid": signer.kid,
                "jwks_url": f"{sub.base}/v1/stream/__ds/jwks.json",
            },
        }
    if config.wake_stream is not None:
        shown["wake_stream"] = config.wake_stream
    shown["lease_ttl_ms"] = config.lease_ttl_ms
    if config.description is not None:
        shown["description"] = config.description
    shown["generation"] = sub.generation
    return shown


@router.get(RESERVED + "/jwks.json")
async def jwks(request: Request) -> Response:
    """The public keys wakes are signed with (a JSON Web Key Set): public, so that a receiver
    without credentials of the broker verifies its wakes."""
    signer = await _subs(request).signer()
    return _json(signer.jwks, media_type=JWKS_TYPE)


@router.put(SUBS)
async def put_subscription(request: Request, sub_id: str, principal: Caller) -> Response:
    """Create a subscription (201), or find the same one (200); 409 for another."""
    tenant = _writer(request, principal).tenant
    checked_id(sub_id)
    config = parse_config(await _body(request))
    if config.webhook_url is not None:
        checked_url(services(request).webhook_config, config.webhook_url)
    subs = _subs(request)
    created = await subs.put(tenant, sub_id, config, _base(request))
    return _json(await view(subs, await subs.get(tenant, sub_id)), 201 if created else 200)


@router.get(SUBS)
async def get_subscription(request: Request, sub_id: str, principal: Caller) -> Response:
    tenant = _writer(request, principal).tenant
    subs = _subs(request)
    return _json(await view(subs, await subs.get(tenant, checked_id(sub_id))))


@router.delete(SUBS, status_code=204)
async def delete_subscription(request: Request, sub_id: str, principal: Caller) -> Response:
    tenant = _writer(request, principal).tenant
    await _subs(request).delete(tenant, checked_id(sub_id))
    return Response(status_code=204)


@router.post(SUBS + "/streams", status_code=204)
async def add_streams(request: Request, sub_id: str, principal: Caller) -> Response:
    tenant = _writer(request, principal).tenant
    body = await _body(request)
    _only(body, {"streams"})
    paths = stream_list(body.get("streams"))
    await _subs(request).link(tenant, checked_id(sub_id), "add", paths)
    return Response(status_code=204)


@router.delete(SUBS + "/streams/{path:path}", status_code=204)
async def remove_stream(request: Request, sub_id: str, path: str, principal: Caller) -> Response:
    tenant = _writer(request, principal).tenant
    await _subs(request).link(tenant, checked_id(sub_id), "remove", [path])
    return Response(status_code=204)


def _wake(wake: Wake) -> dict[str, Any]:
    return {
        "subscription_id": wake.sub_id,
        "wake_id": wake.wake_id,
        "generation": wake.generation,
        "token": wake.token,
        "lease_ttl_ms": wake.config.lease_ttl_ms,
        "streams": [s.json() for s in wake.streams],
    }


@router.post(SUBS + "/claim")
async def claim(request: Request, sub_id: str, principal: Caller) -> Response:
    """A pull-wake worker claims the pending wake: 200, 204 (nothing pending), 409 (held)."""
    tenant = _writer(request, principal).tenant
    body = await _body(request)
    _only(body, {"worker"})
    worker = body.get("worker")
    if not isinstance(worker, str) or not 0 < len(worker) <= 256:
        raise BadRequest("worker must be a string of 1 to 256 characters", code="bad_request")
    try:
        wake = await _subs(request).claim(tenant, checked_id(sub_id), worker)
    except AlreadyClaimed as exc:
        error = {"code": exc.code, "message": exc.message, "current_holder": exc.holder}
        return _json({"error": error}, 409)
    return Response(status_code=204) if wake is None else _json(_wake(wake))


def _token(request: Request) -> str:
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send the wake's token as Authorization: Bearer <token>")
    return token.strip()


def _generation(body: dict[str, Any]) -> tuple[str, int]:
    wake_id, generation = body.get("wake_id"), body.get("generation")
    if not isinstance(wake_id, str) or not wake_id:
        raise BadRequest("wake_id must be the wake's id", code="bad_request")
    if type(generation) is not int or generation < 1:
        raise BadRequest("generation must be the wake's generation (a whole number)")
    return wake_id, generation


def _acks(value: object) -> list[tuple[str, str]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest("acks must be a list of {stream, offset}", code="bad_request")
    acks = []
    for ack in value:
        if (
            not isinstance(ack, dict)
            or set(ack) != {"stream", "offset"}
            or not isinstance(ack["stream"], str)
            or not isinstance(ack["offset"], str)
        ):
            raise BadRequest("acks must be a list of {stream, offset}", code="bad_request")
        acks.append((ack["stream"], offset_of(cursor_of(ack["offset"]))))
    return acks


async def _ack(request: Request, sub_id: str) -> Response:
    token = _token(request)
    body = await _body(request)
    _only(body, {"wake_id", "generation", "acks", "done"})
    wake_id, generation = _generation(body)
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise BadRequest("done must be true or false", code="bad_request")
    next_wake, _ = await _subs(request).ack(
        request.query_params.get("tenant"),
        checked_id(sub_id),
        token=token,
        wake_id=wake_id,
        generation=generation,
        acks=_acks(body.get("acks")),
        done=done,
    )
    return _json({"ok": True, "next_wake": next_wake})


@router.post(SUBS + "/ack")
async def ack(request: Request, sub_id: str) -> Response:
    """A pull-wake worker acks under its claim (and ends the wake with ``done``)."""
    return await _ack(request, sub_id)


@router.post(SUBS + "/callback")
async def callback(request: Request, sub_id: str) -> Response:
    """A webhook receiver acks under the wake it was sent (and ends it with ``done``)."""
    return await _ack(request, sub_id)


@router.post(SUBS + "/release", status_code=204)
async def release(request: Request, sub_id: str) -> Response:
    """A pull-wake worker gives its claim up: the wake goes to the next claim."""
    token = _token(request)
    body = await _body(request)
    _only(body, {"wake_id", "generation"})
    wake_id, generation = _generation(body)
    await _subs(request).ack(
        request.query_params.get("tenant"),
        checked_id(sub_id),
        token=token,
        wake_id=wake_id,
        generation=generation,
        acks=[],
        done=True,
    )
    return Response(status_code=204)
