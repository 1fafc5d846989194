"""The linters and the strict type checker are part of the suite: main stays clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_and_format_are_clean() -> None:
    check = _run("ruff", "check", ".")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr
