"""Completion webhooks' configuration: the signing secret, the URLs, the hosts a turn may name.

The ground floor of :mod:`broker.webhooks` (which queues notifications) and
:mod:`broker.notifier` (which sends them): the settings check their values here at start, and
both sides read the parsed form, :class:`WebhookConfig`.

Signatures follow the Standard Webhooks scheme: the secret is ``whsec_<base64>``, and
``webhook-signature`` is ``v1,<base64 of HMAC-SHA256("<id>.<timestamp>.<body>")>``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re
import urllib.parse
from typing import TYPE_CHECKING

from broker.errors import BadRequest, NotAllowed

if TYPE_CHECKING:
    from broker.settings import Settings

SECRET_PREFIX = "whsec_"
# The Standard Webhooks advice for a secret's size.
SECRET_MIN_BYTES = 24
SECRET_MAX_BYTES = 64
MAX_URL_CHARS = 2048
SCHEMES = ("http", "https")
_HOST_ENTRY = re.compile(r"^(\*|(\*\.)?[a-z0-9]([a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\])$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@|+:-]{0,127}$")  # as keys.TENANT_PATTERN


class WebhookConfigError(ValueError):
    """A webhook setting's value is unusable (the settings raise it as their own error)."""


def decode_secret(raw: str) -> bytes:
    """The key of a ``whsec_<base64>`` secret; ``WebhookConfigError`` when it is not one."""
    if not raw.startswith(SECRET_PREFIX):
        raise WebhookConfigError("must have the form whsec_<base64>")
    try:
        key = base64.b64decode(raw[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise WebhookConfigError("must be whsec_ followed by standard base64") from None
    if not SECRET_MIN_BYTES <= len(key) <= SECRET_MAX_BYTES:
        raise WebhookConfigError(
            f"must hold {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes, not {len(key)}"
        )
    return key


def new_secret() -> str:
    """A random secret in the ``whsec_`` form (32 bytes)."""
    import secrets

    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def webhook_id(stream_id: str, attempt: int) -> str:
    """The ``webhook-id`` of the notification of one attempt's end: the same on every try, so a
    receiver deduplicates by it; a new attempt (continue, regenerate) has a new one."""
    return f"msg_{stream_id}_{attempt}"


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of a body sent at ``timestamp`` (Unix seconds)."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def parse_url(raw: str) -> urllib.parse.SplitResult:
    """A webhook URL: http or https, with a host, no credentials, at most 2048 characters;
    ``WebhookConfigError`` otherwise."""
    if not raw or len(raw) > MAX_URL_CHARS:
        raise WebhookConfigError(f"must be a URL of 1 to {MAX_URL_CHARS} characters")
    if not raw.isascii() or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in raw):
        raise WebhookConfigError("must be ASCII without spaces or control characters")
    try:
        url = urllib.parse.urlsplit(raw)
        url.port  # noqa: B018  # raises ValueError for a port out of range
    except ValueError:
        raise WebhookConfigError("is not a URL") from None
    if url.scheme.lower() not in SCHEMES:
        raise WebhookConfigError("must be an http:// or https:// URL")
    if not url.hostname:
        raise WebhookConfigError("must name a host")
    if url.username is not None or url.password is not None:
        raise WebhookConfigError("must not hold credentials (the signature proves the sender)")
    return url


def parse_tenant_urls(raw: str | None) -> dict[str, str]:
    """``tenant=url,tenant=url`` as a mapping; ``WebhookConfigError`` for a bad pair."""
    found: dict[str, str] = {}
    for pair in (raw or "").split(","):
        if not pair.strip():
            continue
        tenant, equals, url = pair.strip().partition("=")
        if not equals or not _TENANT.match(tenant):
            raise WebhookConfigError("must be tenant=url pairs, comma-separated")
        if tenant in found:
            raise WebhookConfigError(f"names tenant {tenant!r} twice")
        try:
            parse_url(url)
        except WebhookConfigError as exc:
            raise WebhookConfigError(f"the URL of tenant {tenant!r} {exc}") from None
        found[tenant] = url
    return found


def parse_hosts(raw: str | None) -> tuple[str, ...]:
    """The host allow-list: names (``hooks.example.com``), ``*.example.com`` (any name under
    it), ``[::1]``-style literals, or ``*`` (any host)."""
    hosts = tuple(h.strip().lower() for h in (raw or "").split(",") if h.strip())
    for host in hosts:
        if not _HOST_ENTRY.match(host):
            raise WebhookConfigError(f"has an entry that is not a host name: {host[:64]!r}")
    return hosts


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``host`` (lower case, IPv6 without brackets) matches an allow-list entry."""
    for entry in allowed:
        if entry == "*" or entry.strip("[]") == host:
            return True
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookConfig:
    """The parsed webhook settings. ``key`` is None when webhooks are off (no secret)."""

    key: bytes | None
    default_url: str | None
    tenant_urls: dict[str, str]
    hosts: tuple[str, ...]
    secured: bool  # the broker has credentials: per-turn URLs need an allow-list

    @classmethod
    def from_settings(cls, settings: Settings, *, secured: bool) -> WebhookConfig:
        """Parsed from settings that were checked at start (their values parse)."""
        secret = settings.webhook_secret
        return cls(
            decode_secret(secret) if secret else None,
            settings.webhook_url or None,
            parse_tenant_urls(settings.webhook_urls),
            parse_hosts(settings.webhook_hosts),
            secured,
        )

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def tenant_url(self, tenant: str | None) -> str | None:
        """The URL configured for a tenant's turns (``None``: an open broker's), if any."""
        if self.key is None:
            return None
        if tenant is not None and tenant in self.tenant_urls:
            return self.tenant_urls[tenant]
        return self.default_url

    def turn_url(self, raw: str) -> str:
        """A turn's own ``notify.url``, checked: 400 ``bad_notify`` when malformed, 422
        ``notify_not_allowed`` when webhooks are off or its host is not allowed."""
        try:
            url = parse_url(raw)
        except WebhookConfigError as exc:
            raise BadRequest(f"notify.url {exc}", code="bad_notify") from None
        if self.key is None:
            raise NotAllowed(
                "completion webhooks are off on this broker (BROKER_WEBHOOK_SECRET is unset)",
                code="notify_not_allowed",
            )
        if not self.host_allowed(url.hostname or ""):
            if not self.hosts:
                message = (
                    "this broker takes no per-turn notify URLs (BROKER_WEBHOOK_HOSTS is unset "
                    "and credentials are on)"
                )
            else:
                message = f"notify.url's host {url.hostname!r} is not in BROKER_WEBHOOK_HOSTS"
            raise NotAllowed(message, code="notify_not_allowed")
        return raw

    def host_allowed(self, host: str) -> bool:
        """Whether a per-turn URL may name ``host``: the allow-list decides; without one, any
        host on an open broker and none on a secured one."""
        if not self.hosts:
            return not self.secured
        return host_allowed(host.lower(), self.hosts)
