"""The `rlgateway` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from rlgateway.cli import main


def test_help_is_instant_and_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from rlgateway.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'rlgateway --help imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout
    assert "model" in out.stdout


def test_model_tiny_builds_a_loadable_directory_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "tiny", str(out), "--seed", "3"]) == 0
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").is_file()
    assert "built the tiny model" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    assert main(["model", "tiny", str(tmp_path / "other")]) == 2
    assert "error" in capsys.readouterr().err
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    assert main(["model", "tiny", str(tmp_path / "x"), "--size", "huge"]) == 2
    assert "--size must be one of" in capsys.readouterr().err


def test_model_tiny_moe_builds_a_qwen3_moe_with_the_same_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "tiny", str(tmp_path / "dense")]) == 0
    assert main(["model", "tiny", str(tmp_path / "moe"), "--moe"]) == 0
    assert "built the tiny MoE model" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / "moe")
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    dense_tokenizer = (tmp_path / "dense" / "tokenizer.json").read_bytes()
    assert (tmp_path / "moe" / "tokenizer.json").read_bytes() == dense_tokenizer


def test_generate_prints_text_tokens_and_json(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model), "--chat", "hi", "--max-tokens", "12"]
    assert main([*args, "--temperature", "0", "--show-tokens", "--ignore-eos"]) == 0
    table = capsys.readouterr().out
    assert "logprob" in table
    assert "finish_reason: length" in table
    assert main([*args, "--seed", "5", "--json", "-n", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    samples = [json.loads(line) for line in lines]
    assert len(samples) == 2
    for s in samples:
        n = len(s["token_ids"])
        assert 1 <= n <= 12
        assert len(s["logprobs"]) == len(s["versions"]) == n
        assert all(lp <= 0 for lp in s["logprobs"])
    # a seed makes the run reproducible (sample i uses seed + i)
    assert main([*args, "--seed", "5", "--json", "-n", "2"]) == 0
    again = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [s["token_ids"] for s in again] == [s["token_ids"] for s in samples]


def test_generate_streams_text_for_a_raw_prompt(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--model", str(tiny_model), "--prompt", "abc", "--seed", "1"]) == 0
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "temperature must be in"),
        (["--top-p", "0"], "top_p must be in"),
        (["--max-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--messages", "not json"], "not valid JSON"),
        (["--messages", '{"role": "user"}'], "must be a JSON list"),
        (["--max-tokens", "100000"], "context is"),
        ([], "give a prompt"),
    ],
)
def test_generate_bad_input_exits_2_with_advice(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    prompt = [] if "--messages" in extra or not extra else ["--prompt", "x"]
    assert main(["generate", "--model", str(tiny_model), *prompt, *extra]) == 2
    assert message in capsys.readouterr().err


def test_generate_unknown_model_dir_says_how_to_build_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "rlgateway model tiny" in capsys.readouterr().err


def test_serve_refuses_a_bad_engine_setting_before_loading_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--max-prefill-tokens", "0"]) == 2
    assert "bad setting: max_prefill_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "dtype"), [([], "auto"), (["--dtype", "bfloat16"], "bfloat16")])
def test_serve_dtype_reaches_the_gateway_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flag: list[str], dtype: str
) -> None:
    import uvicorn

    import rlgateway.app

    seen: list[object] = []
    monkeypatch.setattr(rlgateway.app, "create_app", lambda settings, **_: seen.append(settings))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert main(["serve", "--database-url", db, "--admin-token", "t", *flag]) == 0
    assert [getattr(s, "dtype", None) for s in seen] == [dtype]


def test_serve_refuses_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
