"""The layers of docs/architecture.md hold: each room imports only the rooms below it or beside
it that the document allows, and every module of the package has a room in the document.

Imports are read from the source (an import under ``if TYPE_CHECKING:`` is for annotations only,
and does not count). A new module fails here until it is given a room, here and in the document.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "broker"
DOCUMENT = ROOT / "docs" / "architecture.md"

GROUND = {
    "broker",
    "broker.canonical",
    "broker.compression",
    "broker.connection",
    "broker.deps",
    "broker.embedded_redis",
    "broker.errors",
    "broker.keys",
    "broker.logs",
    "broker.memory",
    "broker.metrics",
    "broker.numbers",
    "broker.offsets",
    "broker.periodic",
    "broker.redis_calls",
    "broker.scripts",
    "broker.settings",
    "broker.sse",
    "broker.vocabulary",
    "broker.webhook_config",
}
SHARED = {"broker.admission", "broker.auth", "broker.jobs", "broker.webhooks"}
READING = {
    "broker.fanout",
    "broker.frames",
    "broker.reader",
    "broker.relay",
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
TURNS = {"broker.turns"}
# Durable Streams' own streams: a service beside the core. The HTTP door reaches it through the
# package's public names and its pure protocol rules, never its keys, scripts or replies.
DURABLE_STORE_DOORS = {"broker.durable_store", "broker.durable_store.protocol"}
ASSEMBLY = {"broker.app", "broker.__main__"}

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
    if module.startswith(("broker.api", "broker.dialects")):
        return "http"
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


def test_the_api_side_never_loads_the_generation_side() -> None:
    """What an API-role process imports for turns and reads holds nothing of the worker."""
    reached: set[str] = set()
    todo = [
        "broker.turns",
        "broker.reader",
        "broker.relay",
        "broker.viewer",
        "broker.api.routes",
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
            for name in ("KeySpace", "StreamKeys", "StreamScripts", '"ds_create"', '"ds_append"')
        )
    )
    assert outside == []
