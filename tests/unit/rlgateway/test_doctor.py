"""`rlgateway doctor`: each check finds what is there, fails or warns on what is not, and says
the command that fixes it; the exit status is 1 exactly when a check failed."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from rlgateway.cli import main
from rlgateway.commands.doctor import (
    check_database,
    check_disk,
    check_extra,
    check_server_python,
)
from store import migrate
from store.db import Database


def fake_python(tmp_path: Path, name: str, body: str) -> str:
    """An 'interpreter' that ignores its arguments and runs `body` (a shell script)."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_server_venv_check_reports_the_version_or_the_import_error(tmp_path: Path) -> None:
    good = fake_python(tmp_path, "good", "echo 0.32.0")
    other = fake_python(tmp_path, "other", "echo 0.11.1")
    broken = fake_python(
        tmp_path, "broken", "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1"
    )
    ok = check_server_python("vllm", good)
    assert (ok.status, ok.detail) == ("ok", f"vllm 0.32.0 at {good}")
    assert "the tests pin 0.32.0" in check_server_python("vllm", other).detail
    failed = check_server_python("vllm", broken)
    assert failed.status == "fail"
    assert "No module named 'vllm'" in failed.detail
    assert "--vllm-python" in failed.fix
    assert check_server_python("sglang", None).status == "warn"
    missing = check_server_python("sglang", str(tmp_path / "nope"))
    assert missing.status == "fail"
    assert "does not exist" in missing.detail


def test_extra_check_names_the_install_command() -> None:
    assert check_extra("dev", ("json",)).status == "ok"
    c = check_extra("megatron", ("json", "no_such_package.core"))
    assert (c.status, c.fix) == ("warn", "pip install -e '.[megatron]'")
    assert "no_such_package.core" in c.detail


def test_database_check_follows_the_schema(fresh_url: str) -> None:
    before = check_database(fresh_url, named=True)
    if fresh_url.startswith("sqlite"):  # a named file that is not there fails, and is not made
        assert before.status == "fail"
        assert "no database file yet" in before.detail
        assert not Path(fresh_url.removeprefix("sqlite:///")).exists()
        assert check_database(fresh_url, named=False).status == "warn"
    else:
        assert before.status == "warn"
        assert "empty" in before.detail
    assert "rlgateway db upgrade" in before.fix

    async def upgrade() -> None:
        db = Database(fresh_url)
        try:
            await migrate.upgrade(db)
        finally:
            await db.dispose()

    asyncio.run(upgrade())
    after = check_database(fresh_url, named=True)
    assert after.status == "ok"
    assert migrate.head_revision() in after.detail


def test_database_check_fails_on_an_unreachable_server() -> None:
    c = check_database("postgresql://postgres@127.0.0.1:1/nothing", named=True)
    assert c.status == "fail"
    assert "cannot connect" in c.detail


def test_disk_check_warns_under_the_threshold(tmp_path: Path) -> None:
    assert check_disk([tmp_path / "not" / "yet"], min_free_gb=0.0).status == "ok"
    low = check_disk([tmp_path], min_free_gb=1e9)
    assert low.status == "warn"
    assert "RLGATEWAY_CACHE_DIR" in low.fix


def test_doctor_exits_1_exactly_when_a_check_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLGATEWAY_SGLANG_PYTHON", raising=False)
    good = fake_python(tmp_path, "good", "echo 0.32.0")
    db = tmp_path / "store.db"
    args = ["doctor", "--json", "--vllm-python", good, "--database-url", f"sqlite:///{db}"]
    assert main(args) == 1  # the database it was told to use is not there
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["database"]["status"] == "fail"
    assert checks["vllm venv"]["status"] == "ok"
    assert checks["torch device"]["status"] == "ok"

    assert main(["db", "upgrade", "--database-url", f"sqlite:///{db}"]) == 0
    capsys.readouterr()
    assert main(["doctor", *args[2:]]) == 0  # the same, as text
    out = capsys.readouterr().out
    assert "ready" in out
    assert "-> pip install 'sglang[all]'" in out  # a warning says what to do
