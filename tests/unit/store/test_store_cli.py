"""`rlgateway db upgrade|current`, called as rlgateway/cli.py dispatches it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlgateway.commands.db import run_db
from rlgateway.errors import CLIError
from store.migrate import head_revision


def _args(command: str, url: str | None) -> argparse.Namespace:
    return argparse.Namespace(command="db", db_command=command, database_url=url)


def test_upgrade_then_current_on_a_new_sqlite_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/sub/rl.db"
    with pytest.raises(CLIError, match="rlgateway db upgrade"):
        run_db(_args("current", url))  # nothing there yet, and `current` creates nothing
    assert not (tmp_path / "sub" / "rl.db").exists()

    assert run_db(_args("upgrade", url)) == 0
    assert f"to revision {head_revision()} (head)" in capsys.readouterr().out
    assert run_db(_args("upgrade", url)) == 0
    assert "already at revision" in capsys.readouterr().out
    assert run_db(_args("current", url)) == 0
    assert capsys.readouterr().out.strip().endswith(f": {head_revision()} (head)")


def test_the_url_comes_from_the_environment_when_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLGATEWAY_DATABASE_URL", f"sqlite:///{tmp_path}/env.db")
    assert run_db(_args("upgrade", None)) == 0
    assert (tmp_path / "env.db").is_file()
    monkeypatch.delenv("RLGATEWAY_DATABASE_URL")
    monkeypatch.chdir(tmp_path)
    assert run_db(_args("upgrade", None)) == 0
    assert (tmp_path / "rlgateway.db").is_file()
    assert "rlgateway.db" in capsys.readouterr().out


def test_bad_and_unreachable_urls_are_cli_errors() -> None:
    with pytest.raises(CLIError, match="sqlite:///PATH"):
        run_db(_args("upgrade", "mysql://u@h/db"))
    # Port 1 on loopback: nothing listens, so the connection is refused at once.
    with pytest.raises(CLIError, match=r"cannot connect to postgresql\+asyncpg://u:\*\*\*@"):
        run_db(_args("current", "postgresql://u:secret@127.0.0.1:1/nope"))
