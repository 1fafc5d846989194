"""The dependency rule (docs/architecture.md, "Layers"), read from the code's own imports.

    rlgateway/ (the command, the demo, the embedded trainer)
        -> gateway/ (HTTP service)      trainer/ (training)
               -> engines/ (inference)      store/ (trajectories)

Arrows point down only: engines and store import neither gateway nor trainer; gateway and trainer
do not import each other; nothing but tests and benchmarks imports the composition layer;
agents_examples import nothing of ours (they are what a user writes).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
OURS = ("engines", "store", "gateway", "trainer", "migrations", "rlgateway")

FORBIDDEN: dict[str, set[str]] = {
    "engines": {"store", "gateway", "trainer", "rlgateway", "migrations"},
    "store": {"engines", "gateway", "trainer", "rlgateway"},
    "migrations": {"engines", "gateway", "trainer", "rlgateway"},
    "gateway": {"trainer", "rlgateway"},
    "trainer": {"gateway", "rlgateway"},
    "agents_examples": set(OURS),
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Top-level packages of ours that `path` imports (at any depth: lazy imports count too),
    with the line of each import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in OURS:
                found.add((top, node.lineno))
    return found


def violations() -> list[str]:
    out = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for top, line in sorted(imported_packages(path)):
                if top in forbidden:
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    return out


def test_arrows_point_down_only() -> None:
    assert violations() == []


def test_the_rule_sees_a_lazy_import(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from trainer.config import TrainConfig\n    import gateway.app\n")
    assert imported_packages(bad) == {("trainer", 2), ("gateway", 3)}


@pytest.mark.parametrize(
    "modules",
    [
        # the HTTP service on remote engines: every route, the wiring, the composed app
        "gateway.app, gateway.protocols.openai.routes, gateway.routes.runs, gateway.routes.admin, "
        "gateway.routes.ui, gateway.remote_engine, rlgateway.app",
        # the run config, read by `rlgateway train --config` before anything heavy
        "trainer.config, rlgateway.cli",
    ],
)
def test_the_web_service_and_the_config_import_no_torch(modules: str) -> None:
    code = f"import sys, {modules}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_store_imports_its_postgresql_driver_on_postgresql_only() -> None:
    """A gateway on SQLite never loads asyncpg: the store's PostgreSQL hot path
    (`store.turns_pg`, `store.sessions_pg`) is imported where a PostgreSQL store uses it."""
    code = "import sys, store, rlgateway.app, trainer.loop; print('asyncpg' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_no_file_cites_a_path_outside_the_repository() -> None:
    """The design lives in docs/architecture.md; nothing points at the brief it started from."""
    outside = ("../" + "shared", "DESIGN" + ".md")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    cited = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file():
            continue  # deleted in the work tree, not yet in the index
        text = path.read_bytes().decode(errors="replace")
        cited += [f"{name.decode()}: {word}" for word in outside if word in text]
    assert cited == []


# -- inside the gateway: a neutral core, one package per protocol, no circle ---------------------

PROTOCOLS = ("openai", "responses", "anthropic")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """The modules of ours that `path` imports, by full dotted name, at any depth (lazy and
    type-only imports count: a circle through them is still a circle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            for alias in node.names:  # `from gateway.protocols.openai import routes`
                sub = f"{node.module}.{alias.name}"
                if (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file():
                    found.add(sub)
    return {m for m in found if m.split(".")[0] in OURS}


def gateway_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in sorted((ROOT / "gateway").rglob("*.py"))}
    return {
        name: {m for m in imported_modules(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_the_turn_core_imports_no_protocol_route_or_wiring() -> None:
    outside = ("gateway.protocols", "gateway.routes", "gateway.deps", "gateway.app")
    bad = [
        f"{name} imports {m}"
        for name, imports in gateway_graph().items()
        if name.startswith("gateway.core")
        for m in imports
        if m.startswith(outside)
    ]
    assert bad == []


def test_no_protocol_imports_another() -> None:
    bad = [
        f"{name} imports {m}"
        for name, imports in gateway_graph().items()
        for p in PROTOCOLS
        if name.startswith(f"gateway.protocols.{p}")
        for m in imports
        for q in PROTOCOLS
        if q != p and m.startswith(f"gateway.protocols.{q}")
    ]
    assert bad == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_gateway_has_no_import_circle() -> None:
    assert circles(gateway_graph()) == []


def test_the_circle_check_can_fail() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
