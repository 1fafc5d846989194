"""The docs' mechanical claims hold: every path `docs/file-tree.md` names exists, and every
module of the shipped packages, every top-level folder and every documentation page is named
there (a module added without a line, or a line left behind by a move, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
TREE = ROOT / "docs" / "file-tree.md"
NAME_COLUMN = 26
"""Where a line's description starts; a line indented this far continues a description."""
PACKAGES = (
    "gateway",
    "gateway/core",
    "gateway/routes",
    "gateway/protocols",
    "engines",
    "store",
    "trainer",
    "rlgateway",
)
"""Their modules (not those of their subpackages, which the tree may describe as a whole)."""


def tree_paths(text: str) -> list[str]:
    """The repository paths the fenced tree names, from its indentation (two spaces a level)
    and the names left of the description column (`a.py, b.py` names two files in one
    folder; `routes/x.py, y.py` both in routes/)."""
    block = text.split("```", 2)[1]
    paths: list[str] = []
    parents: list[str] = []
    for line in block.splitlines():
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if not stripped or indent >= NAME_COLUMN:
            continue
        described = len(line) > NAME_COLUMN and line[NAME_COLUMN - 1] == " " != line[NAME_COLUMN]
        left = line[:NAME_COLUMN].strip() if described else re.split(r"\s{2,}", stripped)[0]
        names = [n.strip() for n in left.split(",")]
        depth = indent // 2
        parents = parents[:depth]
        base = "/".join(parents)
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        for i, name in enumerate(names):
            rel = name if i == 0 or "/" in name.rstrip("/") else folder + name
            paths.append(f"{base}/{rel}".lstrip("/").rstrip("/"))
        parents.append(names[0].rstrip("/"))
    return paths


def test_every_path_the_tree_names_exists() -> None:
    paths = tree_paths(TREE.read_text())
    assert len(paths) > 100
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == [], f"docs/file-tree.md names paths that do not exist: {missing}"


def test_every_module_folder_and_page_is_named() -> None:
    named = set(tree_paths(TREE.read_text()))
    wanted = [
        str(p.relative_to(ROOT))
        for package in PACKAGES
        for p in sorted((ROOT / package).glob("*.py"))
        if p.name != "__init__.py"
    ]
    wanted += [
        p.name
        for p in sorted(ROOT.iterdir())
        if p.is_dir()
        and not p.name.startswith(".")
        and (ROOT / ".git").exists()
        and p.name not in {"build", "dist", "runs"}
        and not p.name.endswith(".egg-info")
        and any(p.glob("*"))
        and _tracked(p)
    ]
    unnamed = [w for w in wanted if w not in named]
    text = TREE.read_text()
    unnamed += [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name not in text]
    assert unnamed == [], f"give these a line in docs/file-tree.md: {unnamed}"


def test_the_parser_reads_nesting_and_shared_folders() -> None:
    text = (
        "```\n"
        "a/                        x\n"
        "  b.py, c.py              y, z\n"
        "  d/e.py, f.py\n"
        "                          described here, g\n"
        "  long_name.py, others.py described\n"
        "```"
    )
    assert tree_paths(text) == [
        "a",
        "a/b.py",
        "a/c.py",
        "a/d/e.py",
        "a/d/f.py",
        "a/long_name.py",
        "a/others.py",
    ]


def _tracked(folder: Path) -> bool:
    """Whether git tracks anything under `folder` (a venv or a run's outputs are not part of
    the repository)."""
    import subprocess

    out = subprocess.run(
        ["git", "ls-files", "--", str(folder.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return bool(out.stdout.strip())


TOPS = (
    "gateway",
    "engines",
    "store",
    "trainer",
    "rlgateway",
    "tests",
    "bench",
    "docs",
    "examples",
    "configs",
    "migrations",
    "agents_examples",
    ".ci",
)
_TOP = "|".join(map(re.escape, TOPS))
PATH_IN_TEXT = re.compile(rf"(?<![\w./-])((?:{_TOP})/(?:[\w.-]+/)*(?:[\w-]+\.\w+|[\w-]+/))")
"""A repository path in prose: a top-level folder, then a file with an extension or a folder
ending in `/` (`gateway/core/turn.py`, `tests/support/`; not a ratio such as gateway/direct)."""


def test_every_repository_path_the_docs_name_exists() -> None:
    missing, seen = [], 0
    for doc in ("README.md", "BENCHMARKS.md", "docs/architecture.md", "docs/file-tree.md"):
        for path in sorted(set(PATH_IN_TEXT.findall((ROOT / doc).read_text()))):
            seen += 1
            if not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
    assert seen > 100
    assert missing == [], missing


def test_the_path_pattern_finds_paths_and_skips_prose() -> None:
    text = "see `gateway/core/turn.py`, tests/support/ and the ratio gateway/direct 0.44"
    assert PATH_IN_TEXT.findall(text) == ["gateway/core/turn.py", "tests/support/"]
