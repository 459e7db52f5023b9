"""Completion webhooks' configuration: the signing secret, the URLs, the hosts a turn may name.

The ground floor of :mod:`broker.webhooks` (which queues notifications) and
:mod:`broker.notifier` (which sends them): the settings check their values here at start, and
both sides read the parsed form, :class:`WebhookConfig`.

A turn's own ``notify.url`` makes the broker call an address its client chose, so it passes two
checks, both pure and both here: the URL's host and port must match an entry of
``BROKER_WEBHOOK_HOSTS`` (:class:`HostEntry`; an entry without a port allows 80 and 443 only),
and every address its host stands for must be public (:func:`address_kind`), unless the operator
allows private ones (``BROKER_WEBHOOK_ALLOW_PRIVATE``) or lists the address itself. The URL is
checked when the turn is accepted (an IP literal's address at once) and again at send time,
after the name is resolved (:mod:`broker.notifier` connects to the address it checked). URLs the
operator configures (``BROKER_WEBHOOK_URL``, ``BROKER_WEBHOOK_URLS``) are trusted as written.

Signatures follow the Standard Webhooks scheme: the secret is ``whsec_<base64>``, and
``webhook-signature`` is ``v1,<base64 of HMAC-SHA256("<id>.<timestamp>.<body>")>``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import re
import socket
import urllib.parse
from typing import Literal, Protocol

from broker.errors import BadRequest, NotAllowed

SECRET_PREFIX = "whsec_"
# The Standard Webhooks advice for a secret's size.
SECRET_MIN_BYTES = 24
SECRET_MAX_BYTES = 64
MAX_URL_CHARS = 2048
SCHEMES = ("http", "https")
_NAME_ENTRY = re.compile(r"^(\*|(\*\.)?[a-z0-9]([a-z0-9.-]*[a-z0-9])?)$")
# What a host name may look like to the C resolver as an IPv4 address ("127.1", "0x7f.1").
_NUMERIC_HOST = re.compile(r"^[0-9a-fx.]+$")
# The ports an entry without one allows.
DEFAULT_PORTS = (80, 443)
# RFC 6052's well-known NAT64 prefix: its addresses reach the IPv4 address in their last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Why a notify URL or one of its addresses is refused (the metric's label, a fixed set).
RefusalReason = Literal["host", "port", "address"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("host", "port", "address")
# What an address is, for the rule and for messages; only "global" goes without an allowance.
AddressKind = Literal["global", "loopback", "private", "link-local", "unspecified", "multicast"]
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@|+:-]{0,127}$")  # as vocabulary.TENANT_PATTERN


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


@dataclasses.dataclass(frozen=True, slots=True)
class HostEntry:
    """One entry of ``BROKER_WEBHOOK_HOSTS``: a host pattern (``*``, a name, ``*.<domain>``) or
    an address or range (``network``), and a port (None: 80 and 443)."""

    pattern: str  # "" for an address entry
    network: IPNetwork | None = None
    port: int | None = None

    def matches_host(self, host: str, address: IPAddress | None) -> bool:
        """Whether the entry names ``host`` (lower case; ``address`` when it is an IP literal).
        Names match names only; an address entry matches the literals in it."""
        if self.network is not None:
            return address is not None and address in self.network
        if self.pattern == "*":
            return True
        if address is not None:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:])
        return host == self.pattern

    def allows_port(self, port: int) -> bool:
        return port in DEFAULT_PORTS if self.port is None else port == self.port


ANY_HOST = HostEntry("*")


def _entry_port(text: str, raw: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise WebhookConfigError(f"has an entry with a bad port: {raw[:64]!r}")
    return int(text)


def _entry_network(text: str, raw: str) -> IPNetwork | None:
    """The address or range an entry's host names, or None for a name."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "/" in text or ":" in text:
            raise WebhookConfigError(
                f"has an entry with a bad address: {raw[:64]!r} ({exc})"
            ) from None
        return None


def parse_entry(raw: str) -> HostEntry:
    """One allow-list entry: ``hooks.example.com``, ``*.example.com``, ``*``, ``10.0.0.5``,
    ``10.0.0.0/8``, ``[::1]``, ``[fd00::/8]``, each with an optional ``:port``."""
    text = raw.strip().lower()
    port = None
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise WebhookConfigError(f"has an entry that is not [address]:port: {raw[:64]!r}")
        if rest:
            port = _entry_port(rest[1:], raw)
        network = _entry_network(host, raw)
        if network is None or network.version != 6:
            raise WebhookConfigError(f"has a bracketed entry that is not IPv6: {raw[:64]!r}")
        return HostEntry("", network, port)
    if text.count(":") > 1:
        raise WebhookConfigError(
            f"has an IPv6 entry without brackets: {raw[:64]!r} (write [::1] or [::1]:8080)"
        )
    host, colon, port_text = text.partition(":")
    if colon:
        port = _entry_port(port_text, raw)
    network = _entry_network(host, raw)
    if network is not None:
        return HostEntry("", network, port)
    if not _NAME_ENTRY.match(host):
        raise WebhookConfigError(f"has an entry that is not a host name: {raw[:64]!r}")
    return HostEntry(host, None, port)


def parse_hosts(raw: str | None) -> tuple[HostEntry, ...]:
    """The host allow-list (entries as :func:`parse_entry` reads them), comma-separated."""
    return tuple(parse_entry(item) for item in (raw or "").split(",") if item.strip())


def host_allowed(host: str, port: int, allowed: tuple[HostEntry, ...]) -> bool:
    """Whether an entry names ``host`` (lower case, IPv6 without brackets) with ``port``."""
    address = literal_address(host)
    return any(e.matches_host(host, address) and e.allows_port(port) for e in allowed)


def literal_address(host: str) -> IPAddress | None:
    """The address a URL's host spells, if it is one: a literal, or a numeric form the C
    resolver reads as IPv4 (``127.1``, ``0x7f000001``); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_HOST.match(host) and any(c.isdigit() for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_kind(address: IPAddress) -> AddressKind:
    """What an address is: ``global`` (public) or the kind of non-public address it is."""
    inner = _embedded_ipv4(address)
    if inner is not None:
        return address_kind(inner)
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_global and not (
        isinstance(address, ipaddress.IPv6Address) and address.is_site_local
    ):
        return "global"
    return "private"  # RFC 1918, ULA, shared (100.64/10), reserved, documentation, ...


LOOPBACK = ipaddress.IPv4Address("127.0.0.1")


def is_localhost(host: str) -> bool:
    """Whether a name is RFC 6761's ``localhost`` (or one under it): always loopback."""
    return host == "localhost" or host.endswith(".localhost")


class WebhookSettings(Protocol):
    """The settings :meth:`WebhookConfig.from_settings` reads (``broker.settings.Settings``
    has them; named here so that this module, which the settings import, imports none back)."""

    @property
    def webhook_secret(self) -> str | None: ...
    @property
    def webhook_url(self) -> str | None: ...
    @property
    def webhook_urls(self) -> str | None: ...
    @property
    def webhook_hosts(self) -> str | None: ...
    @property
    def webhook_allow_private(self) -> int: ...
    @property
    def webhook_allow_loopback(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookConfig:
    """The parsed webhook settings. ``key`` is None when webhooks are off (no secret)."""

    key: bytes | None
    default_url: str | None
    tenant_urls: dict[str, str]
    hosts: tuple[HostEntry, ...]
    secured: bool  # the broker has credentials: per-turn URLs need an allow-list
    allow_private: bool = False  # BROKER_WEBHOOK_ALLOW_PRIVATE: loopback and private addresses
    allow_loopback: bool = False  # BROKER_WEBHOOK_ALLOW_LOOPBACK: loopback addresses only

    @classmethod
    def from_settings(cls, settings: WebhookSettings, *, secured: bool) -> WebhookConfig:
        """Parsed from settings that were checked at start (their values parse)."""
        secret = settings.webhook_secret
        return cls(
            decode_secret(secret) if secret else None,
            settings.webhook_url or None,
            parse_tenant_urls(settings.webhook_urls),
            parse_hosts(settings.webhook_hosts),
            secured,
            bool(settings.webhook_allow_private),
            bool(settings.webhook_allow_loopback),
        )

    @property
    def operator_urls(self) -> frozenset[str]:
        """The URLs the settings name: the operator's own, trusted as written."""
        urls = set(self.tenant_urls.values())
        if self.default_url:
            urls.add(self.default_url)
        return frozenset(urls)

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
        refusal = self.url_refusal(url)
        if refusal is not None:
            raise NotAllowed(refusal[1], code="notify_not_allowed")
        return raw

    @property
    def entries(self) -> tuple[HostEntry, ...]:
        """The allow-list in force: the setting's; without one, any host (ports 80 and 443) on
        an open broker and none on a secured one."""
        if self.hosts:
            return self.hosts
        return () if self.secured else (ANY_HOST,)

    def url_refusal(self, url: urllib.parse.SplitResult) -> tuple[RefusalReason, str] | None:
        """Why a per-turn URL may not be sent to, from the URL alone (its host, its port, the
        address of an IP literal or of ``localhost``), or None; the resolved addresses are
        checked at send time (:meth:`address_refusal`)."""
        host = (url.hostname or "").lower()
        port = url.port or (443 if url.scheme.lower() == "https" else 80)
        entries = self.entries
        if not entries:
            return "host", (
                "this broker takes no per-turn notify URLs (BROKER_WEBHOOK_HOSTS is unset "
                "and credentials are on)"
            )
        address = literal_address(host)
        named = [e for e in entries if e.matches_host(host, address)]
        if not named:
            return "host", f"notify.url's host {host!r} is not in BROKER_WEBHOOK_HOSTS"
        if not any(e.allows_port(port) for e in named):
            return "port", (
                f"notify.url's port {port} is not allowed for host {host!r}: an entry of "
                "BROKER_WEBHOOK_HOSTS without a port allows 80 and 443 only (list the host "
                "with its port, as host:port)"
            )
        if address is None and is_localhost(host):
            address = LOOPBACK  # RFC 6761: the name is loopback whatever a resolver says
        kind = None if address is None else self.address_refusal(address)
        if kind is not None:
            return "address", self.address_message(host, kind)
        return None

    def address_refusal(self, address: IPAddress) -> AddressKind | None:
        """The kind of ``address`` when a webhook may not go there, else None: public addresses
        are fine; unspecified and multicast ones never; the others when an entry of
        ``BROKER_WEBHOOK_HOSTS`` is that address or a range holding it, and loopback and private
        ones also with ``BROKER_WEBHOOK_ALLOW_PRIVATE`` (link-local ones, where cloud metadata
        services live, only when listed), and loopback ones with
        ``BROKER_WEBHOOK_ALLOW_LOOPBACK``."""
        kind = address_kind(address)
        if kind == "global":
            return None
        if kind in ("unspecified", "multicast"):
            return kind
        inner = _embedded_ipv4(address) or address
        if any(e.network is not None and inner in e.network for e in self.hosts):
            return None
        if self.allow_private and kind in ("loopback", "private"):
            return None
        if self.allow_loopback and kind == "loopback":
            return None
        return kind

    @staticmethod
    def address_message(host: str, kind: AddressKind) -> str:
        """The refusal of a URL whose host is (or resolves to) a non-public address."""
        return (
            f"notify.url's host {host!r} is a {kind} address: completion webhooks go to public "
            "addresses only, unless BROKER_WEBHOOK_ALLOW_PRIVATE=1 (loopback and private) or "
            "BROKER_WEBHOOK_HOSTS lists the address or its range"
        )
