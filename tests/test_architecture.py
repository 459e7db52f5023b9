"""The layers of docs/architecture.md hold: each room imports only the rooms below it or beside
it that the document allows, and every module of the package has a room in the document.

Imports are read from the source. For the layers, an import under ``if TYPE_CHECKING:`` is for
annotations only, and does not count; for circles it counts (a circle of annotations is still a
circle of concepts, and one unguarded import away from a circular import at run time). A new
module fails here until it is given a room, here and in the document; a module past 600 lines
fails too (``broker/ruff.toml`` holds each function to a complexity of 15).

The HTTP layer (``api/``, ``dialects/``, ``http.py``) touches no Redis: it reads no ``.redis``,
``.keys`` or ``.deps`` attribute and imports neither the Redis client nor the key builder, the
Redis calls, the scripts or the dependencies; it asks the core (``Turns``, ``Streams``, ...).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "broker"
DOCUMENT = ROOT / "docs" / "architecture.md"

GROUND = {
    "broker",
    "broker.canonical",
    "broker.approval_rules",
    "broker.client_tools",
    "broker.compression",
    "broker.connection",
    "broker.content",
    "broker.deps",
    "broker.embedded_redis",
    "broker.errors",
    "broker.keys",
    "broker.logs",
    "broker.memory",
    "broker.metrics",
    "broker.networks",
    "broker.numbers",
    "broker.offsets",
    "broker.periodic",
    "broker.redis_calls",
    "broker.scripts",
    "broker.settings",
    "broker.sse",
    "broker.structured_output",
    "broker.vocabulary",
    "broker.webhook_config",
}
SHARED = {"broker.admission", "broker.auth", "broker.jobs", "broker.webhooks"}
READING = {
    "broker.fanout",
    "broker.follow",
    "broker.frames",
    "broker.pages",
    "broker.reader",
    "broker.relay",
    "broker.sequence_index",
    "broker.ticker",
    "broker.viewer",
}
WRITING = {
    "broker.generation",
    "broker.lease",
    "broker.ledger",
    "broker.notifier",
    "broker.output",
    "broker.retry",
    "broker.tool_steps",
    "broker.tools",
    "broker.worker",
}
TURNS = {"broker.approvals", "broker.turns", "broker.turn_records", "broker.turn_requests"}
# Durable Streams' own streams: a service beside the core (its subscriptions, their wake loop and
# their pure rules included: durable_store/subscriptions.py, wakes.py, sub_model.py). The HTTP
# door (dialects/durable/routes.py and subscriptions.py) reaches it through the package's public
# names and its pure protocol rules, never its keys, scripts or replies.
DURABLE_STORE_DOORS = {"broker.durable_store", "broker.durable_store.protocol"}
ASSEMBLY = {"broker.app", "broker.__main__", "broker.workers"}

# Which rooms a room may import at run time (besides itself).
MAY_IMPORT = {
    "ground": {"ground"},
    "shared": {"ground"},
    "providers": {"ground"},
    "reading": {"ground", "shared"},
    "writing": {"ground", "shared", "providers"},
    "turns": {"ground", "shared", "providers"},
    "durable_store": {"ground", "reading"},
    "http": {"ground", "shared", "providers", "reading", "turns", "durable_store"},
    "assembly": {
        "ground",
        "shared",
        "providers",
        "reading",
        "writing",
        "turns",
        "durable_store",
        "http",
    },
}


def room(module: str) -> str | None:
    for name, members in (
        ("ground", GROUND),
        ("shared", SHARED),
        ("reading", READING),
        ("writing", WRITING),
        ("turns", TURNS),
        ("assembly", ASSEMBLY),
    ):
        if module in members:
            return name
    if module == "broker.providers" or module.startswith("broker.providers."):
        return "providers"
    if module == "broker.durable_store" or module.startswith("broker.durable_store."):
        return "durable_store"
    if module == "broker.http" or module.startswith(("broker.api", "broker.dialects")):
        return "http"
    if module == "broker.fastpath" or module.startswith("broker.fastpath."):
        return "ground"
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def runtime_imports(path: Path) -> set[str]:
    """The broker modules ``path`` imports when it runs (not those for type checking only)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "broker":
                    found.add(node.module)
                    for alias in node.names:  # ``from broker import redis_calls``
                        if f"{node.module}.{alias.name}" in MODULES:
                            found.add(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "broker")
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(ast.parse(path.read_text("utf-8")).body)
    return found


def test_every_module_has_a_room() -> None:
    assert [module for module in MODULES if room(module) is None] == []


MODULE_LINES = 600  # a module past this is two modules


def test_no_module_is_past_its_length() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text("utf-8").splitlines())) > MODULE_LINES
    }
    assert long == {}, f"split these modules (at most {MODULE_LINES} lines each): {long}"


def test_the_document_names_every_module() -> None:
    text = DOCUMENT.read_text("utf-8")
    missing = []
    for module, path in MODULES.items():
        if path.name == "__init__.py" or module.startswith(
            ("broker.api.", "broker.dialects.", "broker.providers.", "broker.durable_store.")
        ):
            continue  # the document names these packages as rooms, not each module
        if f"`{path.relative_to(PACKAGE).as_posix()}`" not in text:
            missing.append(module)
    assert missing == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module: str) -> None:
    own = room(module)
    assert own is not None
    allowed = MAY_IMPORT[own] | {own}
    wrong = sorted(
        f"{imported} ({room(imported)})"
        for imported in runtime_imports(MODULES[module])
        if imported in MODULES and room(imported) not in allowed
    )
    assert wrong == [], f"{module} ({own}) may import only {sorted(allowed)}"


# The only rooms that reach the fast path: the assembly wires it in, the Redis client builds its
# pools with it, and the body and header limits name its share of a request's scope.
FAST_PATH_USERS = {"broker.app", "broker.__main__", "broker.connection", "broker.api.limits"}


def test_only_the_assembly_and_the_redis_client_reach_the_fast_path() -> None:
    """Every private name of uvicorn's and redis-py's stays in one room (broker.fastpath)."""
    reaching = sorted(
        module
        for module, path in MODULES.items()
        if not module.startswith("broker.fastpath")
        and any(name.startswith("broker.fastpath") for name in runtime_imports(path))
    )
    assert set(reaching) <= FAST_PATH_USERS, reaching


def test_the_api_side_never_loads_the_generation_side() -> None:
    """What an API-role process imports for turns and reads holds nothing of the worker."""
    reached: set[str] = set()
    todo = [
        "broker.turns",
        "broker.reader",
        "broker.relay",
        "broker.viewer",
        "broker.http",
        "broker.api.routes",
        "broker.dialects.openai",
        "broker.dialects.aisdk",
    ]
    while todo:
        module = todo.pop()
        if module in reached or module not in MODULES:
            continue
        reached.add(module)
        todo.extend(runtime_imports(MODULES[module]))
    assert sorted(reached & WRITING) == []


def test_the_http_layer_reaches_the_durable_store_through_its_service() -> None:
    """A door imports the Durable Streams service's package (its service, requests and results)
    and its pure protocol rules, never its keys, scripts or reply decoders; and no module but
    the service's own builds its keys or calls its scripts."""
    wrong = sorted(
        f"{module} imports {imported}"
        for module, path in MODULES.items()
        if room(module) == "http"
        for imported in runtime_imports(path)
        if room(imported) == "durable_store" and imported not in DURABLE_STORE_DOORS
    )
    assert wrong == []
    outside = sorted(
        module
        for module, path in MODULES.items()
        if room(module) != "durable_store"
        and module != "broker.scripts"  # loads every script at start, the ds_* ones included
        and any(
            name in path.read_text("utf-8")
            for name in (
                "KeySpace",
                "StreamKeys",
                "StreamScripts",
                "SubKeys",
                '"ds_create"',
                '"ds_append"',
                '"ds_sub_claim"',
            )
        )
    )
    assert outside == []


# --- the HTTP layer touches no Redis ---------------------------------------------------------

# What the HTTP layer may not import: the Redis client, and the core's Redis plumbing.
REDIS_MODULES = ("redis", "broker.keys", "broker.redis_calls", "broker.deps", "broker.scripts")
# Attributes that are Redis, or carry it (a ``Deps`` holds the client and the key builder).
REDIS_ATTRIBUTES = {"redis", "keys", "deps"}
# ``Services`` keeps the process's ``Deps`` (private) for the relay and readiness: the type
# only, for its annotation; it reads neither Redis nor a key itself.
ALLOWED_REDIS_IMPORTS = {("broker.http", "broker.deps")}


def http_layer(module: str) -> bool:
    return room(module) == "http"


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, those for type checking included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:  # ``from broker import redis_calls``
                if f"{node.module}.{alias.name}" in MODULES:
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def redis_uses(path: Path) -> list[str]:
    """The Redis attribute uses of ``path``, each as ``line: .name``."""
    return [
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in REDIS_ATTRIBUTES
    ]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if http_layer(m)))
def test_the_http_layer_reads_no_redis_attribute(module: str) -> None:
    uses = redis_uses(MODULES[module])
    assert uses == [], (
        f"{module} reads Redis itself: ask the core (Turns, Streams, SequenceIndex) instead"
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if http_layer(m)))
def test_the_http_layer_imports_no_redis(module: str) -> None:
    wrong = sorted(
        imported
        for imported in all_imports(MODULES[module])
        if imported.startswith(REDIS_MODULES) and (module, imported) not in ALLOWED_REDIS_IMPORTS
    )
    assert wrong == [], f"{module} imports Redis plumbing: ask the core instead"


def test_the_rules_catch_what_they_forbid(tmp_path: Path) -> None:
    """The checks above can fail: a handler that reads Redis is seen."""
    handler = tmp_path / "handler.py"
    handler.write_text(
        "from redis.asyncio import Redis\n"
        "from broker.keys import Keys\n"
        "async def h(rt):\n"
        "    return await rt.redis.get(rt.keys.turn('c', 't'))\n",
        "utf-8",
    )
    assert redis_uses(handler) == ["4: .redis", "4: .keys"]
    assert {"redis.asyncio", "broker.keys"} <= all_imports(handler)


# --- no import circles ------------------------------------------------------------------------

# Import edges left out of the circle check, each with its reason (none now).
ALLOWED_EDGES: set[tuple[str, str]] = set()


def ancestors(module: str) -> list[str]:
    """The packages Python imports before ``module``: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Each module's imports among the package's modules, type-only ones included.

    Importing ``a.b.c`` runs ``a/b/__init__.py`` first, so an import of it is an edge to the
    packages above it too, except those the importer is inside (already being imported).
    """
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        own = set(ancestors(module)) | ({module} if path.name == "__init__.py" else set())
        edges: set[str] = set()
        for imported in all_imports(path):
            if (module, imported) in ALLOWED_EDGES:
                continue
            for target in [*ancestors(imported), imported]:
                if target in MODULES and target not in own and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """One circle through each group of modules that import each other, as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    for group in groups:
        yield shortest_circle(graph, group)


def shortest_circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the group's first module, found breadth first."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop(0)
        for target in sorted(graph[module] & group):
            if target == start:
                return [*paths[module], start]
            if target not in paths:
                paths[target] = [*paths[module], target]
                todo.append(target)
    raise AssertionError(f"no circle in {sorted(group)}")


def test_no_import_circles() -> None:
    found = [" -> ".join(circle) for circle in cycles(import_graph())]
    assert found == [], "modules import each other (type-only imports included):\n" + "\n".join(
        found
    )


def test_a_circle_is_reported_with_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert list(cycles(graph)) == [["a", "b", "c", "a"]]
    assert list(cycles({"a": {"b"}, "b": set()})) == []


def test_the_handlers_services_hold_no_redis() -> None:
    """What the assembly hands the doors has no Redis client, key builder or dependencies in
    the open (``Services`` keeps the dependencies private, for the relay)."""
    from broker.http import Services

    names = {field.name for field in dataclasses.fields(Services)}
    assert names & (REDIS_ATTRIBUTES | {"blocking_redis", "replica_reads", "scripts"}) == set()
    assert {"turns", "streams", "sequences"} <= names
