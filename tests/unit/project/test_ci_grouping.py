"""CI's two workers share the tests as `tests/conftest.py` says: every test that runs vLLM goes to
one worker, and so do a module's tests that share a module-scoped fixture, so that each vLLM
server, gateway or torchrun job a module shares starts once, not once per worker; the rest go
test by test.

The grouping rests on two things that broke silently before: the suite's hook must mark the tests
before xdist's worker reads the marks, and xdist 3.8 writes the group into a node id attribute
that pytest 9.2 no longer reads (hence `pytest<9.2` in the dev extra). A small suite, run the way
`.ci/run` runs the real one, shows where each test went.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.slow

CONFTEST = """
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the suite's own hook)

@pytest.fixture
def vllm_url():
    return "http://vllm"
"""

TESTS = """
import pytest

@pytest.mark.vllm
@pytest.mark.parametrize("n", range(3))
def test_marked(n):
    pass

def test_by_fixture(vllm_url):
    pass

@pytest.mark.parametrize("n", range(6))
def test_free(n):
    pass
"""

SHARED = """
import pytest

@pytest.fixture(scope="module")
def server():
    return "started once"

@pytest.mark.parametrize("n", range(4))
def test_shared(server, n):
    pass

@pytest.mark.xdist_group("named")
def test_named(server):
    pass
"""


def test_every_vllm_test_goes_to_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouping.py").write_text(TESTS)
    (tmp_path / "test_module.py").write_text(SHARED)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: runs vLLM\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
         "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    placed = re.findall(r"\[(gw\d)\] .*PASSED \S+::(test_\w+)(\S*)", out.stdout)
    vllm = [(w, suffix) for w, name, suffix in placed if name in ("test_marked", "test_by_fixture")]
    assert len(vllm) == 4, out.stdout
    assert all(suffix.endswith("@vllm") for _, suffix in vllm), out.stdout
    assert len({worker for worker, _ in vllm}) == 1, out.stdout
    free = [suffix for _, name, suffix in placed if name == "test_free"]
    assert len(free) == 6, out.stdout
    assert not any("@" in s for s in free), out.stdout
    shared = [(w, suffix) for w, name, suffix in placed if name == "test_shared"]
    assert len(shared) == 4, out.stdout
    assert all(suffix.endswith("@test_module.py") for _, suffix in shared), out.stdout
    assert len({worker for worker, _ in shared}) == 1, out.stdout
    assert [suffix for _, name, suffix in placed if name == "test_named"] == ["@named"]
