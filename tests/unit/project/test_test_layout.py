"""The tests are laid out like the code: unit tests in one folder per package, integration tests in
one folder per area, what they share in tests/support/ (no test module imports another), and no
test file a newcomer cannot read in one sitting."""

from __future__ import annotations

import ast

from tests.support.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"
MAX_LINES = 500
PACKAGES = {"trainer", "engines", "gateway", "store", "rlgateway", "project"}
AREAS = {"gateway", "store", "engines", "trainer", "deployment", "experiments"}


def test_unit_and_integration_tests_sit_in_their_packages_and_areas() -> None:
    for kind, folders in (("unit", PACKAGES), ("integration", AREAS)):
        root = TESTS / kind
        loose = sorted(
            p.name for p in root.glob("*.py") if p.name not in ("__init__.py", "conftest.py")
        )
        assert loose == [], f"tests/{kind}/ holds files outside a folder: {loose}"
        assert {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"} == folders
        for folder in folders:
            assert (root / folder / "__init__.py").exists(), f"tests/{kind}/{folder} is no package"


def test_no_test_file_is_over_500_lines() -> None:
    """Test files, that is: tests/support/ holds helpers (a fake server, the float64 reference)."""
    long = {
        str(p.relative_to(REPO_ROOT)): n
        for p in TESTS.rglob("test_*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these (helpers go to tests/support/): {long}"


def test_no_test_module_imports_another() -> None:
    """What two test modules share lives in tests/support/ (or a conftest), not in either."""
    found = []
    for p in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            imported = node.module if isinstance(node, ast.ImportFrom) else None
            if imported and imported.rsplit(".", 1)[-1].startswith("test_"):
                found.append(f"{p.relative_to(REPO_ROOT)}: from {imported}")
    assert found == []
