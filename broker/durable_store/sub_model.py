"""Durable Streams subscriptions, the pure part: a subscription's configuration as a PUT gives
it, its glob as a Lua pattern, the URL rule of its webhook, and the ed25519 signing of a wake.

A subscription names its streams by a glob (``pattern``: ``*`` is any run of characters but
``/``, ``**`` any run at all, ``?`` one character but ``/``), by a list (``streams``), or both.
A ``webhook`` subscription's wakes are POSTed to its URL, signed; a ``pull-wake`` one's are
announced on a stream of its tenant (``wake_stream``) for workers to claim.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
import urllib.parse
from typing import Any, Final, Literal

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from broker.errors import BadRequest
from broker.webhook_config import (
    LOOPBACK,
    WebhookConfig,
    WebhookConfigError,
    is_localhost,
    literal_address,
    parse_url,
)

Kind = Literal["webhook", "pull-wake"]
KINDS: Final = ("webhook", "pull-wake")
SUB_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
LEASE_TTL_MS: Final = (100, 3_600_000)
DEFAULT_LEASE_TTL_MS: Final = 30_000
MAX_STREAMS: Final = 1000  # explicit streams in one request
MAX_PATTERN: Final = 1024
MAX_DESCRIPTION: Final = 4096
_FIELDS: Final = {"type", "pattern", "streams", "webhook", "wake_stream", "lease_ttl_ms"}
_LUA_MAGIC: Final = frozenset("^$()%.[]*+-?")


class UrlRejected(BadRequest):
    """A webhook URL the broker will not send to (400 ``WEBHOOK_URL_REJECTED``)."""

    code = "WEBHOOK_URL_REJECTED"


def checked_id(raw: str) -> str:
    if not SUB_ID.match(raw):
        raise BadRequest(
            "a subscription id is 1 to 128 letters, digits, '.', '_', ':' or '-'",
            code="bad_subscription_id",
        )
    return raw


def lua_pattern(glob: str) -> str:
    """The anchored Lua pattern of a subscription's glob."""
    out = ["^"]
    i = 0
    while i < len(glob):
        char = glob[i]
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char in _LUA_MAGIC:
            out.append("%" + char)
        else:
            out.append(char)
        i += 1
    out.append("$")
    return "".join(out)


def glob_matches(glob: str, path: str) -> bool:
    """The same rule in Python (what the Lua pattern does, for tests and docs)."""
    wild = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
    regex = "".join(
        wild.get(part, re.escape(part)) for part in re.split(r"(\*\*|\*|\?)", glob) if part
    )
    return re.fullmatch(regex, path, re.S) is not None


@dataclasses.dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    """A subscription as its PUT describes it (checked)."""

    kind: Kind
    pattern: str | None
    streams: tuple[str, ...]
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    @property
    def canonical(self) -> str:
        """The configuration as JSON that two equal PUTs write alike."""
        return orjson.dumps(dataclasses.asdict(self), option=orjson.OPT_SORT_KEYS).decode()

    @classmethod
    def of_json(cls, text: str) -> SubscriptionConfig:
        raw = orjson.loads(text)
        raw["streams"] = tuple(raw["streams"])
        return cls(**raw)

    @property
    def matcher(self) -> str:
        """The registry's line for the append's mark: the Lua pattern and the wake stream."""
        pattern = "" if self.pattern is None else lua_pattern(self.pattern)
        return f"{pattern}\n{self.wake_stream or ''}"


def _text(body: dict[str, Any], name: str, limit: int) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise BadRequest(f"{name} must be a string of 1 to {limit} characters", code="bad_request")
    return value


def stream_list(value: object, name: str = "streams") -> tuple[str, ...]:
    """A list of stream paths (1 to MAX_STREAMS strings)."""
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_STREAMS
        or not all(isinstance(p, str) and 0 < len(p) <= 4096 for p in value)
    ):
        raise BadRequest(f"{name} must be a list of 1 to {MAX_STREAMS} paths", code="bad_request")
    return tuple(dict.fromkeys(value))


def _lease_ttl(body: dict[str, Any]) -> int:
    value = body.get("lease_ttl_ms", DEFAULT_LEASE_TTL_MS)
    low, high = LEASE_TTL_MS
    if type(value) is not int or not low <= value <= high:
        raise BadRequest(f"lease_ttl_ms must be a whole number from {low} to {high}")
    return value


def _webhook_url(body: dict[str, Any]) -> str | None:
    webhook = body.get("webhook")
    if webhook is None:
        return None
    if (
        not isinstance(webhook, dict)
        or set(webhook) != {"url"}
        or not isinstance(webhook["url"], str)
    ):
        raise BadRequest("webhook must be an object with a url (only)", code="bad_request")
    return str(webhook["url"])


def parse_config(body: object) -> SubscriptionConfig:
    """A PUT's body checked: 400 naming the field for anything wrong or unknown."""
    if not isinstance(body, dict):
        raise BadRequest("a subscription is a JSON object", code="bad_request")
    unknown = sorted(set(body) - _FIELDS - {"description"})
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", code="bad_request")
    kind = body.get("type")
    if kind not in KINDS:
        raise BadRequest("type must be 'webhook' or 'pull-wake'", code="bad_request")
    pattern = _text(body, "pattern", MAX_PATTERN)
    streams = () if body.get("streams") is None else stream_list(body["streams"])
    if pattern is None and not streams:
        raise BadRequest("a subscription needs a pattern or streams", code="bad_request")
    url = _webhook_url(body)
    wake_stream = _text(body, "wake_stream", 4096)
    if kind == "webhook" and (url is None or wake_stream is not None):
        raise BadRequest("a webhook subscription needs webhook.url and no wake_stream")
    if kind == "pull-wake" and (wake_stream is None or url is not None):
        raise BadRequest("a pull-wake subscription needs wake_stream and no webhook")
    return SubscriptionConfig(
        kind,
        pattern,
        streams,
        url,
        wake_stream,
        _lease_ttl(body),
        _text(body, "description", MAX_DESCRIPTION),
    )


def url_refusal(config: WebhookConfig, raw: str) -> str | None:
    """Why a subscription's webhook URL is refused, or None. The URL rules of completion
    webhooks: http(s), no credentials; non-public addresses only as the operator allows
    (``BROKER_WEBHOOK_ALLOW_PRIVATE``, ``BROKER_WEBHOOK_ALLOW_LOOPBACK``, an address entry of
    ``BROKER_WEBHOOK_HOSTS``); and, when ``BROKER_WEBHOOK_HOSTS`` is set, its host and port
    rules, without which a broker with credentials takes none (an open one takes any host and
    port). Names are resolved and their addresses checked again at send time."""
    try:
        url = parse_url(raw)
    except WebhookConfigError as exc:
        return f"webhook.url {exc}"
    if config.hosts:
        refusal = config.url_refusal(url)
        return None if refusal is None else refusal[1].replace("notify.url", "webhook.url")
    if config.secured:
        return (
            "this broker takes no subscription webhook URLs (BROKER_WEBHOOK_HOSTS is unset and "
            "credentials are on)"
        )
    host = (url.hostname or "").lower()
    address = literal_address(host)
    if address is None and is_localhost(host):
        address = LOOPBACK
    kind = None if address is None else config.address_refusal(address)
    if kind is None:
        return None
    return config.address_message(host, kind).replace("notify.url", "webhook.url")


def checked_url(config: WebhookConfig, raw: str) -> str:
    refusal = url_refusal(config, raw)
    if refusal is not None:
        raise UrlRejected(refusal)
    return urllib.parse.urlsplit(raw).geturl()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Signer:
    """The broker's ed25519 wake-signing key (one for every process: see
    :meth:`broker.durable_store.subscriptions.Subscriptions.signer`)."""

    def __init__(self, seed: bytes) -> None:
        self._seed = seed
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.kid = "ds_" + _b64url(hashlib.sha256(self.public).digest()[:12])

    def made_from(self, seed_hex: str) -> bool:
        """Whether this is the key of ``seed_hex`` (the form Redis keeps it in)."""
        return self._seed.hex() == seed_hex

    def header(self, timestamp: int, body: bytes) -> str:
        """``Webhook-Signature``: ``t=<unix s>,kid=<kid>,ed25519=<base64url signature of
        "<t>.<body>">``."""
        signature = self._key.sign(f"{timestamp}.".encode() + body)
        return f"t={timestamp},kid={self.kid},ed25519={_b64url(signature)}"

    @property
    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The JSON Web Key Set a receiver verifies with."""
        key = {
            "kty": "OKP",
            "crv": "Ed25519",
            "x": _b64url(self.public),
            "kid": self.kid,
            "use": "sig",
            "alg": "EdDSA",
        }
        return {"keys": [key]}
