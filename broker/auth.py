"""Who is calling: API keys and JWT bearer tokens name a tenant; attach tokens read one stream.

Three kinds of credentials arrive as ``Authorization: Bearer <credential>``:

* an **API key** from ``BROKER_API_KEYS`` / ``BROKER_API_KEYS_FILE`` (``tenant=key``);
* a **JWT** signed with ``BROKER_JWT_SECRET`` (HS256) or the key in ``BROKER_JWT_PUBLIC_KEY``
  (RS256), whose ``BROKER_JWT_TENANT_CLAIM`` claim names the tenant;
* an **attach token** minted by the broker for one stream: read-only, short-lived, optionally
  one viewer at a time. It may also come as ``?token=`` (``EventSource`` cannot set headers).

With neither API keys nor a JWT key the broker runs open: every caller is the same anonymous
principal and ``Authorization`` is not looked at; a ``?token=`` is still checked, so a share link
keeps its stream and one-viewer limits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time
from pathlib import Path
from typing import Any, Literal

import jwt

from broker.errors import Forbidden, Unauthorized
from broker.settings import Settings, SettingsError
from broker.vocabulary import STREAM_ID_PATTERN, TENANT_PATTERN

ATTACH_AUDIENCE = "broker-attach"
ATTACH_ALGORITHM = "HS256"
MIN_KEY_CHARS = 16
JWT_LEEWAY_S = 10

Kind = Literal["open", "api_key", "jwt", "attach"]


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request."""

    kind: Kind
    tenant: str | None  # None: the broker runs open
    stream_id: str | None = None  # attach tokens: the one stream they read
    token_id: str | None = None  # attach tokens: their id (the one-viewer lock's name)
    one_viewer: bool = False
    expires_at: int | None = None  # JWTs: what they mint may not outlive them
    approve: bool = False  # attach tokens: may also decide the approvals of their turn

    @property
    def may_act(self) -> bool:
        """Whether this caller may start, cancel, retry or read turns (attach tokens may not)."""
        return self.kind != "attach"


OPEN = Principal(kind="open", tenant=None)


@dataclasses.dataclass(frozen=True, slots=True)
class AttachToken:
    token: str
    expires_at: int  # unix seconds


def parse_api_keys(text: str, source: str) -> dict[str, str]:
    """``{sha256(key): tenant}`` from ``tenant=key`` entries (commas or lines; ``#`` comments)."""
    table: dict[str, str] = {}
    lines = [line.strip() for line in text.splitlines()]
    # A comment line is skipped whole, keys and all: a revoked key stays revoked.
    entries = [e.strip() for line in lines if not line.startswith("#") for e in line.split(",")]
    for number, entry in enumerate((e for e in entries if e), start=1):
        tenant, eq, key = entry.partition("=")
        tenant, key = tenant.strip(), key.strip()
        if not eq or not TENANT_PATTERN.fullmatch(tenant):
            # Never echo the entry: it may be a key.
            raise SettingsError(
                f"{source}: entry {number} is not tenant=key with a tenant name of letters, "
                "digits and . _ @ | + : - (at most 128)"
            )
        if len(key) < MIN_KEY_CHARS:
            raise SettingsError(
                f"{source}: the key of tenant {tenant!r} is shorter than {MIN_KEY_CHARS} characters"
            )
        digest = _digest(key)
        if digest in table and table[digest] != tenant:
            raise SettingsError(f"{source}: one key is given to two tenants")
        table[digest] = tenant
    return table


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    """A fresh random API key (256 bits)."""
    return f"bk_{secrets.token_urlsafe(32)}"


class Authenticator:
    """Checks credentials against the settings; mints and checks attach tokens."""

    def __init__(self, settings: Settings, attach_secret: bytes) -> None:
        self._settings = settings
        self.attach_secret = attach_secret  # signs attach tokens; set once, at start
        self._keys: dict[str, str] = {}
        if settings.api_keys:
            self._keys.update(parse_api_keys(settings.api_keys, "BROKER_API_KEYS"))
        if settings.api_keys_file:
            path = Path(settings.api_keys_file)
            try:
                text = path.read_text("utf-8")
            except OSError as exc:
                raise SettingsError(f"BROKER_API_KEYS_FILE: cannot read {path}: {exc}") from None
            for digest, tenant in parse_api_keys(text, str(path)).items():
                if self._keys.get(digest, tenant) != tenant:
                    raise SettingsError("one API key is given to two tenants")
                self._keys[digest] = tenant
        self._jwt_key: str | None = None
        self._jwt_algorithm = "HS256"
        if settings.jwt_secret:
            if len(settings.jwt_secret) < 32:
                raise SettingsError("BROKER_JWT_SECRET must be at least 32 characters")
            self._jwt_key = settings.jwt_secret
        elif settings.jwt_public_key:
            try:
                self._jwt_key = Path(settings.jwt_public_key).read_text("utf-8")
            except OSError as exc:
                raise SettingsError(f"BROKER_JWT_PUBLIC_KEY: cannot read it: {exc}") from None
            self._jwt_algorithm = "RS256"
            try:
                jwt.algorithms.RSAAlgorithm(jwt.algorithms.RSAAlgorithm.SHA256).prepare_key(
                    self._jwt_key
                )
            except Exception as exc:
                raise SettingsError(
                    f"BROKER_JWT_PUBLIC_KEY is not a PEM RSA public key: {exc}"
                ) from None

    @property
    def enabled(self) -> bool:
        """False: the broker runs open (no API keys, no JWT key)."""
        return bool(self._keys) or self._jwt_key is not None

    @property
    def summary(self) -> str:
        parts = []
        if self._keys:
            tenants = len(set(self._keys.values()))
            parts.append(f"{len(self._keys)} API keys for {tenants} tenants")
        if self._jwt_key is not None:
            parts.append(
                f"{self._jwt_algorithm} JWTs (tenant claim {self._settings.jwt_tenant_claim!r})"
            )
        return ", ".join(parts) or "none"

    def authenticate(self, authorization: str | None, query_token: str | None) -> Principal:
        """The caller behind a request's credentials; 401 when they are missing or refused."""
        if query_token is not None:
            # Checked even on an open broker: a share link keeps its stream and viewer limits.
            return self.check_attach(query_token)
        if not self.enabled:
            return OPEN
        if not authorization:
            raise Unauthorized(
                "this broker needs credentials: Authorization: Bearer <key or token>"
            )
        scheme, _, credential = authorization.strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise Unauthorized("use Authorization: Bearer <key or token>")
        tenant = self._keys.get(_digest(credential))
        if tenant is not None:
            return Principal(kind="api_key", tenant=tenant)
        if credential.count(".") == 2:
            if _unverified_audience(credential) == ATTACH_AUDIENCE:
                return self.check_attach(credential)
            if self._jwt_key is not None:
                return self._check_jwt(credential)
        raise Unauthorized("unknown API key or token", code="bad_credentials")

    def check_metrics(self, authorization: str | None) -> None:
        """``/metrics`` needs ``Bearer <BROKER_METRICS_TOKEN>`` when that is set."""
        expected = self._settings.metrics_token
        if not expected:
            return
        scheme, _, credential = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credential.strip().encode(), expected.encode()
        ):
            raise Unauthorized("metrics need Authorization: Bearer <BROKER_METRICS_TOKEN>")

    def _check_jwt(self, token: str) -> Principal:
        assert self._jwt_key is not None
        claim = self._settings.jwt_tenant_claim
        audience = self._settings.jwt_audience
        try:
            claims = jwt.decode(
                token,
                self._jwt_key,
                algorithms=[self._jwt_algorithm],
                audience=audience,
                issuer=self._settings.jwt_issuer,
                leeway=JWT_LEEWAY_S,
                options={"require": ["exp", claim], "verify_aud": audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("the token has expired", code="token_expired") from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"the token is not valid: {exc}", code="bad_token") from None
        tenant = claims.get(claim)
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise Unauthorized(
                f"the token's {claim!r} claim is not a tenant name (letters, digits and "
                ". _ @ | + : -, at most 128)",
                code="bad_token",
            )
        expires = claims.get("exp")
        return Principal(
            kind="jwt", tenant=tenant, expires_at=int(expires) if isinstance(expires, int) else None
        )

    def mint_attach(
        self,
        tenant: str | None,
        stream_id: str,
        ttl_s: float | None,
        one_viewer: bool,
        not_after: int | None = None,
        approve: bool = False,
    ) -> AttachToken:
        """A read-only token for one stream, valid ``ttl_s`` (the default when None), and never
        past ``not_after`` (the expiry of the credential that mints it)."""
        settings = self._settings
        ttl = settings.attach_token_ttl if ttl_s is None else ttl_s
        ttl = max(1.0, min(ttl, settings.attach_token_max_ttl))
        now = int(time.time())
        expires_at = now + int(ttl)
        if not_after is not None:
            expires_at = min(expires_at, not_after)
        claims: dict[str, Any] = {
            "aud": ATTACH_AUDIENCE,
            "sid": stream_id,
            "ten": tenant or "",
            "iat": now,
            "exp": expires_at,
            "jti": secrets.token_hex(12),
        }
        if one_viewer:
            claims["one"] = 1
        if approve:
            claims["apv"] = 1  # the `approve` scope: decide the approvals of this stream's turn
        token = jwt.encode(claims, self.attach_secret, algorithm=ATTACH_ALGORITHM)
        return AttachToken(token, expires_at)

    def check_attach(self, token: str) -> Principal:
        """The principal of an attach token; 401 when forged, expired or malformed."""
        try:
            claims = jwt.decode(
                token,
                self.attach_secret,
                algorithms=[ATTACH_ALGORITHM],
                audience=ATTACH_AUDIENCE,
                options={"require": ["exp", "sid", "jti"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("the attach token has expired", code="token_expired") from None
        except jwt.PyJWTError:
            raise Unauthorized("the attach token is not valid", code="bad_token") from None
        stream_id, tenant = claims.get("sid"), claims.get("ten") or None
        if not isinstance(stream_id, str) or not STREAM_ID_PATTERN.fullmatch(stream_id):
            raise Unauthorized("the attach token is not valid", code="bad_token")
        return Principal(
            kind="attach",
            tenant=tenant if isinstance(tenant, str) else None,
            stream_id=stream_id,
            token_id=str(claims["jti"]),
            one_viewer=bool(claims.get("one")),
            approve=bool(claims.get("apv")),
        )


def require_actor(principal: Principal) -> Principal:
    """403 for attach tokens: they read one stream and can start, cancel or retry nothing."""
    if not principal.may_act:
        raise Forbidden("an attach token can only read its stream", code="read_only")
    return principal


def require_approver(principal: Principal) -> Principal:
    """403 for an attach token without the ``approve`` scope (which of its turn's approvals it
    may decide is the route's to check: only its own stream's)."""
    if not principal.may_act and not principal.approve:
        raise Forbidden(
            "this attach token has no approve scope: it can only read its stream",
            code="read_only",
        )
    return principal


def _unverified_audience(token: str) -> object:
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    return claims.get("aud")
