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
READING = {"broker.fanout", "broker.frames", "broker.reader", "broker.viewer"}
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
ASSEMBLY = {"broker.app", "broker.__main__"}

# Which rooms a room may import at run time (besides itself).
MAY_IMPORT = {
    "ground": {"ground"},
    "shared": {"ground"},
    "providers": {"ground"},
    "reading": {"ground", "shared"},
    "writing": {"ground", "shared", "providers"},
    "turns": {"ground", "shared", "providers"},
    "http": {"ground", "shared", "providers", "reading", "turns"},
    "assembly": {"ground", "shared", "providers", "reading", "writing", "turns", "http"},
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
    if module.startswith(("broker.api", "broker.dialects")):
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


def test_the_document_names_every_module() -> None:
    text = DOCUMENT.read_text("utf-8")
    missing = []
    for module, path in MODULES.items():
        if path.name == "__init__.py" or module.startswith(
            ("broker.api.", "broker.dialects.", "broker.providers.")
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
    todo = ["broker.turns", "broker.reader", "broker.viewer", "broker.api.routes"]
    while todo:
        module = todo.pop()
        if module in reached or module not in MODULES:
            continue
        reached.add(module)
        todo.extend(runtime_imports(MODULES[module]))
    assert sorted(reached & WRITING) == []
