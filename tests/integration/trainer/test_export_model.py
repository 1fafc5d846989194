"""`rlgateway export-model`: a checkpoint of real training steps becomes a Hugging Face model
directory whose weights are the trainer's exactly, which transformers loads (model, tokenizer,
chat template) and scores as the trainer does, and which names the policy version the checkpoint
publishes; every form of SOURCE finds the same checkpoint, and mistakes exit with status 2 and
say what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engines.tiny_model import load_tokenizer
from rlgateway.cli import main
from tests.support.exported_policy import VERSION, Exported, export_trained
from trainer import checkpoint

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def exported(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return export_trained(tiny_model, tmp_path_factory.mktemp("exported"))


def test_the_export_holds_the_trained_weights_exactly(exported: Exported, tiny_model: Path) -> None:
    saved = load_file(exported.out / "model.safetensors")
    state = exported.backend.full_state_dict()
    assert saved.keys() == state.keys()
    for name, tensor in state.items():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], tensor), name
    base = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(saved[k], base[k]) for k in base)  # it is the trained policy
    # The base model's other files, without its weights or the tiny model's build marker.
    assert sorted(p.name for p in exported.out.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "rlgateway_policy.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((exported.out / "rlgateway_policy.json").read_text()) == {
        "version": VERSION,
        "step": VERSION,
        "source": str(exported.checkpoint.resolve()),
    }
    meta = checkpoint.read_meta(exported.checkpoint)
    assert (meta.step, meta.version, meta.model) == (VERSION, VERSION, str(tiny_model.resolve()))


def test_transformers_loads_the_export_and_scores_as_the_trainer(
    exported: Exported, tiny_model: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(exported.out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported.out)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "Write exactly five lowercase letters."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    base = load_tokenizer(tiny_model).apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == base["input_ids"]
    assert GenerationConfig.from_pretrained(exported.out).eos_token_id == [258, 256]

    tokens = [*prompt, *tokenizer.encode("qwert<|im_end|>"), *range(0, 263, 7)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(tokens[1:])[:, None])
    trainer = exported.logprobs(tokens, TEMPERATURE)
    torch.testing.assert_close(logp[:, 0], torch.tensor(trainer[1:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", ["checkpoint", "root", "demo-out", "run-yaml"])
def test_every_source_form_exports_the_newest_checkpoint(
    exported: Exported, tmp_path: Path, form: str
) -> None:
    if form == "checkpoint":
        source = exported.checkpoint
    elif form == "root":
        source = exported.root
    elif form == "demo-out":
        source = tmp_path / "demo-out"
        shutil.copytree(exported.root, source / "checkpoints")
    else:
        source = tmp_path / "run.yaml"
        source.write_text(f"checkpoint_dir: {exported.root}\n")
    out = tmp_path / "out"
    assert main(["export-model", str(source), str(out)]) == 0
    weights = (out / "model.safetensors").read_bytes()
    assert weights == (exported.out / "model.safetensors").read_bytes()
    assert json.loads((out / "rlgateway_policy.json").read_text())["version"] == VERSION


def test_a_checkpoint_that_does_not_record_its_base_model_takes_model(
    exported: Exported, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "checkpoints" / exported.checkpoint.name
    shutil.copytree(exported.checkpoint, old)
    meta = json.loads((old / checkpoint.META).read_text())
    del meta["model"], meta["version"]  # as rlgateway wrote them before
    (old / checkpoint.META).write_text(json.dumps(meta))

    assert main(["export-model", str(old), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "does not record its base model" in err
    assert "--model DIR" in err
    assert not (tmp_path / "a").exists()
    assert main(["export-model", str(old), str(tmp_path / "b"), "--model", str(tiny_model)]) == 0
    # A run config names the model its checkpoints lack.
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {tiny_model}\ncheckpoint_dir: {old.parent}\n")
    assert main(["export-model", str(run), str(tmp_path / "c")]) == 0
    for out in ("b", "c"):
        policy = json.loads((tmp_path / out / "rlgateway_policy.json").read_text())
        assert policy == {"version": VERSION, "step": VERSION, "source": str(old.resolve())}


def test_mistakes_exit_2_saying_what_to_do(
    exported: Exported, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(*args: str) -> str:
        assert main(["export-model", *args]) == 2
        return capsys.readouterr().err

    out = str(tmp_path / "out")
    assert "does not exist" in refused(str(tmp_path / "missing"), out)
    unfinished = tmp_path / "unfinished"
    (unfinished / "step-000004.tmp").mkdir(parents=True)  # a save that never completed
    err = refused(str(unfinished), out)
    assert "holds no complete checkpoint" in err
    assert not Path(out).exists()

    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    err = refused(str(exported.checkpoint), str(full))
    assert "is not empty" in err
    assert "--force" in err
    assert [p.name for p in full.iterdir()] == ["notes.txt"]
    assert main(["export-model", str(exported.checkpoint), str(full), "--force"]) == 0
    assert (full / "model.safetensors").is_file()
    assert not (full / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    err = refused(str(exported.checkpoint), out, "--model", str(other))
    assert "do not fit" in err
    assert "mlp.down_proj.weight" in err
