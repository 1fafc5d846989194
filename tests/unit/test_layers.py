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

ROOT = Path(__file__).resolve().parents[2]
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
        "gateway.app, gateway.routes.openai, gateway.routes.runs, gateway.routes.admin, "
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
