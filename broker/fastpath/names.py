"""The start-up probe: are the private names the fast path touches still there?

Each :class:`PrivateName` says where a name lives and how its presence is checked on the
installed release: a method or class attribute by ``hasattr``, an instance attribute by the
library's own code naming it (the names its functions' code objects load and store). The probe
checks every one; :func:`probe` turns that, and ``BROKER_FAST_PATH``, into a :class:`FastPath`:
which halves are on, and one line saying why any is off. ``tests/test_fastpath_contract.py``
holds each name to what the fast path does with it, on real objects.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import types
from typing import Final

from broker.fastpath.redis_pool import DIRECT_SEND

HTTP: Final = "http"
REDIS: Final = "redis"


@dataclasses.dataclass(frozen=True, slots=True)
class PrivateName:
    """One name of a library's internals that the fast path touches."""

    side: str  # HTTP or REDIS: the half of the fast path that needs it
    library: str  # the distribution whose release may change it
    owner: str  # "module:Class"
    name: str
    kind: str  # "attribute" (of instances: named in the class's code) or "member"

    @property
    def where(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"

    def present(self) -> bool:
        owner = _owner(self.owner)
        if owner is None:
            return False
        if self.kind == "member":
            return hasattr(owner, self.name)
        return self.name in _names_in(owner)


def _owner(spec: str) -> type | None:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    owner = getattr(module, class_name, None)
    return owner if isinstance(owner, type) else None


def _names_in(cls: type) -> set[str]:
    """Every attribute name the code of ``cls`` (and its bases) loads or stores."""
    found: set[str] = set()

    def visit(code: types.CodeType) -> None:
        found.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)

    for klass in cls.__mro__:
        for value in vars(klass).values():
            function = value.fget if isinstance(value, property) else value
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                visit(code)
    return found


def _names(side: str, library: str, owner: str, kind: str, *names: str) -> list[PrivateName]:
    return [PrivateName(side, library, owner, name, kind) for name in names]


_UVICORN_PROTOCOL = "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol"
_UVICORN_CYCLE = "uvicorn.protocols.http.httptools_impl:RequestResponseCycle"
_FLOW = "uvicorn.protocols.http.flow_control:FlowControl"
_POOL = "redis.asyncio.connection:ConnectionPool"
_BLOCKING_POOL = "redis.asyncio.connection:BlockingConnectionPool"
_CONNECTION = "redis.asyncio.connection:AbstractConnection"

# Every private name the fast path touches (the package's docstring says what each is for).
NAMES: tuple[PrivateName, ...] = (
    *_names(
        HTTP, "uvicorn", _UVICORN_PROTOCOL, "member",
        "on_message_begin", "on_headers_complete", "on_message_complete",
        "on_response_complete", "send_400_response",
    ),
    *_names(
        HTTP, "uvicorn", _UVICORN_PROTOCOL, "attribute",
        "pipeline", "cycle", "scope", "url", "root_path", "client", "connections", "flow",
        "transport", "loop", "app",
    ),
    *_names(
        HTTP, "uvicorn", _UVICORN_CYCLE, "attribute",
        "transport", "chunked_encoding", "response_complete", "response_started",
        "disconnected", "flow", "message_event", "scope",
    ),
    *_names(HTTP, "uvicorn", _FLOW, "attribute", "_is_writable_event", "write_paused"),
    *_names(REDIS, "redis", _POOL, "attribute", "_available_connections", "_in_use_connections"),
    *_names(
        REDIS, "redis", _POOL, "member",
        "get_available_connection", "ensure_connection", "maint_notifications_enabled",
    ),
    *_names(REDIS, "redis", _BLOCKING_POOL, "attribute", "_condition"),
    *_names(REDIS, "redis", _BLOCKING_POOL, "member", "can_get_connection"),
    # (the direct send's, which runs before Python 3.12 only: see redis_pool.DIRECT_SEND)
    *(_names(REDIS, "redis", _CONNECTION, "attribute", "_writer") if DIRECT_SEND else []),
    *_names(REDIS, "redis", _CONNECTION, "member", "should_reconnect", "check_health"),
)  # fmt: skip


def version(library: str) -> str:
    """The installed release of ``library`` ("python": the interpreter's)."""
    if library == "python":
        import platform

        return platform.python_version()
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@dataclasses.dataclass(frozen=True, slots=True)
class FastPath:
    """Which halves of the fast path a process runs, and why any is off."""

    http: bool
    redis: bool
    reason: str = ""  # empty while both are on

    @property
    def on(self) -> bool:
        return self.http and self.redis

    def line(self) -> str | None:
        """The one log line for a fast path (half) off, or None while it is all on."""
        if self.on:
            return None
        off = "off"
        if self.http != self.redis:
            off = "off for HTTP" if not self.http else "off for Redis"
        return f"fast path {off}: {self.reason}; serving with stock uvicorn and redis-py"


FAST: Final = FastPath(http=True, redis=True)


def probe(setting: str = "auto") -> FastPath:
    """The fast path this process may run: off when ``setting`` (``BROKER_FAST_PATH``) is
    ``off``; with ``auto``, each half on while every private name it needs is present."""
    if setting == "off":
        return FastPath(http=False, redis=False, reason="BROKER_FAST_PATH=off")
    missing = [name for name in NAMES if not name.present()]
    if not missing:
        return FAST
    sides = {name.side for name in missing}
    shown = ", ".join(
        f"{name.where} ({name.library} {version(name.library)})" for name in missing[:3]
    )
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return FastPath(
        http=HTTP not in sides,
        redis=REDIS not in sides,
        reason=f"missing {shown}{more}",
    )
