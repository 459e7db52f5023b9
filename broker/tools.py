"""The tool registry: what each tool is, how risky a second call is, and how to call it.

A tool has a name, a JSON schema for its arguments, a class and a way to be called:

* ``read``: no side effect; re-running is harmless.
* ``keyed_write``: a side effect the downstream deduplicates by the ``Idempotency-Key`` header
  (or the ``idempotency_key`` a callable receives); re-sending with the same key is safe.
* ``unkeyed_write``: a side effect nothing downstream deduplicates. The ledger claims it once;
  if the outcome of a claimed call is unknown, the turn fails and the call is never re-sent.

Tools come from a file named by ``BROKER_TOOLS`` (JSON, or TOML by extension) or from Python
(:meth:`ToolRegistry.register`) when the broker is embedded::

    {"tools": [{"name": "send_payment", "class": "unkeyed_write",
                "schema": {"type": "object", "required": ["to", "amount"]},
                "endpoint": "http://payments.internal/send", "timeout_s": 10}]}
"""

from __future__ import annotations

import asyncio
import dataclasses
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import orjson

from broker.approval_rules import ApprovalRule, RuleError
from broker.errors import BrokerError
from broker.vocabulary import TOOL_NAME_PATTERN

ToolClass = Literal["read", "keyed_write", "unkeyed_write"]
TOOL_CLASSES: tuple[ToolClass, ...] = ("read", "keyed_write", "unkeyed_write")
NAME_PATTERN = TOOL_NAME_PATTERN

ToolFunction = Callable[[dict[str, Any], str], Awaitable[Any]]
"""A Python tool: ``await fn(arguments, idempotency_key)`` returns a JSON-able result."""


class ToolConfigError(BrokerError, ValueError):
    """The tools file or a registration is invalid."""

    code = "bad_tools"


class ToolError(BrokerError):
    """A tool call failed; ``outcome_known`` is False when it may have taken effect anyway.

    ``code`` is the tool's own (it goes into the ``tool_result`` event), not a broker code.
    """

    def __init__(self, code: str, message: str, *, outcome_known: bool = True) -> None:
        super().__init__(message, code=code)
        self.outcome_known = outcome_known


@dataclasses.dataclass(frozen=True)
class Tool:
    """One registered tool."""

    name: str
    kind: ToolClass
    schema: dict[str, Any]
    endpoint: str | None = None
    timeout_s: float = 30.0
    function: ToolFunction | None = None
    description: str = ""
    approval: ApprovalRule = dataclasses.field(default_factory=ApprovalRule)
    approval_ttl_s: float | None = None  # None: BROKER_APPROVAL_TTL_S

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise ToolConfigError(f"tool name {self.name!r} must match {NAME_PATTERN.pattern}")
        if self.kind not in TOOL_CLASSES:
            raise ToolConfigError(
                f"tool {self.name!r}: class must be one of {', '.join(TOOL_CLASSES)}"
            )
        if (self.endpoint is None) == (self.function is None):
            raise ToolConfigError(f"tool {self.name!r} needs exactly one of endpoint or function")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ToolConfigError(f"tool {self.name!r}: endpoint must be an http(s) URL")
        if self.timeout_s <= 0:
            raise ToolConfigError(f"tool {self.name!r}: timeout_s must be positive")
        if self.approval_ttl_s is not None and not 0 < self.approval_ttl_s <= 31_536_000:
            raise ToolConfigError(
                f"tool {self.name!r}: approval_ttl_s must be positive (at most a year)"
            )
        if self.approval_ttl_s is not None and self.approval.mode == "never":
            raise ToolConfigError(
                f'tool {self.name!r}: approval_ttl_s is set but its approval is "never"'
            )
        try:
            jsonschema.Draft202012Validator.check_schema(self.schema)
        except jsonschema.SchemaError as exc:
            raise ToolConfigError(f"tool {self.name!r}: invalid schema: {exc.message}") from None

    def validate(self, arguments: Any) -> str | None:
        """None when ``arguments`` fit the schema, else what is wrong."""
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(self.schema).iter_errors(arguments)
        )
        return None if error is None else error.message

    @property
    def protection(self) -> str:
        """How a repeated call of this tool is kept from doing harm (for the audit)."""
        if self.kind == "read":
            return "none needed: re-running a read is harmless"
        if self.kind == "keyed_write":
            return "ledger claim + Idempotency-Key: a re-send carries the same key"
        return "ledger claim: runs once; an unknown outcome fails the turn, never re-sent"


class ToolRegistry:
    """The tools one broker may dispatch."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ToolConfigError(f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __iter__(self) -> Any:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @classmethod
    def from_file(cls, path: str | Path) -> ToolRegistry:
        """Load ``{"tools": [...]}`` from a JSON or TOML file."""
        file = Path(path)
        try:
            raw = file.read_bytes()
            data = tomllib.loads(raw.decode()) if file.suffix == ".toml" else orjson.loads(raw)
        except (OSError, ValueError) as exc:
            raise ToolConfigError(f"cannot read tools file {file}: {exc}") from None
        entries = data.get("tools") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ToolConfigError(f"{file}: expected an object with a 'tools' list")
        tools = []
        for entry in entries:
            if not isinstance(entry, dict):
                raise ToolConfigError(f"{file}: every tool must be an object")
            unknown = set(entry) - {
                "name",
                "class",
                "schema",
                "endpoint",
                "timeout_s",
                "description",
                "approval",
                "approval_ttl_s",
            }
            if unknown:
                raise ToolConfigError(f"{file}: unknown tool fields {sorted(unknown)}")
            try:
                tools.append(
                    Tool(
                        name=entry["name"],
                        kind=entry["class"],
                        schema=entry.get("schema", {"type": "object"}),
                        endpoint=entry.get("endpoint"),
                        timeout_s=float(entry.get("timeout_s", 30)),
                        description=str(entry.get("description", "")),
                        approval=ApprovalRule.parse(entry.get("approval")),
                        approval_ttl_s=_ttl(entry.get("approval_ttl_s")),
                    )
                )
            except KeyError as exc:
                raise ToolConfigError(f"{file}: a tool lacks {exc.args[0]!r}") from None
            except RuleError as exc:
                raise ToolConfigError(f"{file}: tool {entry.get('name')!r}: {exc}") from None
        return cls(tools)

    def audit(self) -> str:
        """A table: which tools can double-fire, and how each is protected."""
        rows = [("tool", "class", "can double-fire", "approval", "protection")]
        for tool in self:
            fires = "no" if tool.kind == "read" else "yes, without the ledger"
            rows.append((tool.name, tool.kind, fires, tool.approval.describe(), tool.protection))
        if len(rows) == 1:
            return "no tools registered (set BROKER_TOOLS to a tools file)\n"
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
            for row in rows
        ]
        return "\n".join(lines) + "\n"


def _ttl(value: Any) -> float | None:
    """A tool's ``approval_ttl_s``: a number of seconds, or absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolConfigError(f"approval_ttl_s must be a number of seconds, not {value!r}")
    return float(value)


# The header that tells a tool endpoint whose turn the call is for.
TENANT_HEADER = "Broker-Tenant"


async def invoke(
    tool: Tool,
    arguments: dict[str, Any],
    idempotency_key: str,
    http: httpx.AsyncClient,
    tenant: str | None = None,
) -> Any:
    """Call a tool once; raises ToolError (with whether its outcome is known).

    An endpoint is told the tenant whose turn made the call (``Broker-Tenant``), so that it can
    authorize it; the header is absent on an open broker, whose turns belong to no tenant.
    """
    if tool.function is not None:
        try:
            async with asyncio.timeout(tool.timeout_s):
                return await tool.function(arguments, idempotency_key)
        except ToolError:
            raise
        except TimeoutError:
            raise ToolError(
                "tool_timeout",
                f"{tool.name} took longer than {tool.timeout_s} s",
                outcome_known=False,
            ) from None
        except Exception as exc:
            # A write that raised may have acted first: only a read's failure is certain.
            raise ToolError(
                "tool_error", f"{type(exc).__name__}: {exc}", outcome_known=tool.kind == "read"
            ) from None
    assert tool.endpoint is not None
    headers = {"Idempotency-Key": idempotency_key, "Content-Type": "application/json"}
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    try:
        response = await http.post(
            tool.endpoint,
            content=orjson.dumps({"name": tool.name, "arguments": arguments}),
            headers=headers,
            timeout=tool.timeout_s,
        )
    except httpx.ConnectError as exc:
        # Nothing reached the endpoint: the call certainly did not happen.
        raise ToolError("tool_unreachable", f"cannot reach {tool.endpoint}: {exc}") from None
    except httpx.HTTPError as exc:
        raise ToolError(
            "tool_timeout" if isinstance(exc, httpx.TimeoutException) else "tool_transport",
            f"{type(exc).__name__} calling {tool.endpoint}",
            outcome_known=False,
        ) from None
    if response.status_code >= 500:
        # The endpoint may have acted before failing: for a write, the outcome is unknown.
        raise ToolError(
            "tool_error",
            f"HTTP {response.status_code} from {tool.endpoint}",
            outcome_known=tool.kind == "read",
        )
    if response.status_code >= 400:
        raise ToolError("tool_rejected", f"HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        return response.text
