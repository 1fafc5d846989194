"""The Megatron backend (megatron-core 0.16.1) against Hugging Face and against the FSDP backend.

megatron-core runs here on CPU over gloo through the test harness (tests/support/megatron_cpu.py),
in torchrun workers only (tests/support/workers/megatron_worker.py), so that this process stays
free of it. Every run is `tp_worker.run` (3 steps with warmup, cosine decay, weight decay, clipping
and an entropy bonus; a checkpoint before the last step, resumed in a new backend; published
weights; logprobs), compared with the FSDP backend's same run in this process.

- The conversion HF -> Megatron -> HF is bit-exact for Qwen2 (QKV bias), Qwen3 (q/k norms) and a
  tied Llama, split over 1 and 2 tensor ranks and 1 and 2 stages.
- The last stage's logits equal the Hugging Face model's (1e-5, float32) with tensor parallel 1
  and 2 (the padded vocabulary's slices compared column for column).
- Every step's loss, grad norm, mean logprob and entropy equal the FSDP backend's (rel 1e-5), and
  the weights after 3 steps and the logprobs after them too (1e-5): on one process, tensor
  parallel 2, pipeline parallel 2 (megatron-core's 1F1B schedule), data parallel 2, and `d1t2p2`
  (Qwen2); tensor parallel 2 (Qwen3: q/k norms); one process (Llama: tied embeddings).
- The checkpoint resumes bit for bit, and exports (without megatron-core) to the weights it saved.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engines.tiny_model import tiny_model_dir
from tests.support.parallel_models import build_tiny_qwen3
from tests.support.paths import WORKERS
from tests.support.torchrun import ROOT, max_abs_diff, torchrun
from tests.support.workers import tp_worker
from trainer.backends.config import MegatronBackendConfig
from trainer.config import validate_config
from trainer.megatron.convert import Layout, megatron_names, merge_tensor_ranks, to_hf, to_megatron

WORKER = str(WORKERS / "megatron_worker.py")
"""Run by torchrun, never imported here: it applies the CPU harness to its process."""

ATOL = 1e-5
"""float32: tensor ranks and stages sum the same products in another order than one process."""

RUNS = {
    "qwen2 megatron": ("qwen2", "megatron", 1),
    "qwen2 megatron:t2": ("qwen2", "megatron:t2", 2),
    "qwen2 megatron:p2": ("qwen2", "megatron:p2", 2),
    "qwen2 megatron:d2": ("qwen2", "megatron:d2", 2),
    "qwen2 megatron:d1t2p2": ("qwen2", "megatron:d1t2p2", 4),
    "qwen3 megatron:t2": ("qwen3", "megatron:t2", 2),
    "llama megatron": ("llama", "megatron", 1),
}
"""Run id -> (model, allocation, processes)."""


def build_tiny_llama(out: Path) -> Path:
    """A tiny Llama with tied embeddings (no biases, no q/k norms), seeded."""
    config = LlamaConfig(
        vocab_size=263,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny demo-sized Qwen2 (4 heads, 2 key-value heads: tensor parallel 2 fits), a tiny
    Qwen3 and a tiny tied Llama."""
    return {
        "qwen2": tiny_model_dir(size="demo", seed=0),
        "qwen3": build_tiny_qwen3(tmp_path_factory.mktemp("qwen3")),
        "llama": build_tiny_llama(tmp_path_factory.mktemp("llama")),
    }


@pytest.mark.parametrize("model", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize(("tensor", "pipeline"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_conversion_round_trip_is_bit_exact(
    models: dict[str, Path], model: str, tensor: int, pipeline: int
) -> None:
    hf = AutoModelForCausalLM.from_pretrained(str(models[model]), dtype=torch.float32)
    state = hf.state_dict()
    layout = Layout.of(hf.config, tensor, pipeline)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pipeline):
        shards = [to_megatron(state, layout, r, stage) for r in range(tensor)]
        assert all(s.keys() == set(megatron_names(layout, stage)) for s in shards)
        for name in megatron_names(layout, stage):
            full = merge_tensor_ranks(name, [s[name] for s in shards])
            back |= to_hf(layout, name, stage, full)
    assert back.keys() == state.keys()  # a tied model's lm_head.weight too
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_fused_qkv_interleaves_query_groups(models: dict[str, Path]) -> None:
    # megatron-core's layout, written out: group g's 2 query heads, then its key, then its value
    hf = AutoModelForCausalLM.from_pretrained(str(models["qwen2"]), dtype=torch.float32)
    state, layout = hf.state_dict(), Layout.of(hf.config, 2)
    d = layout.head_dim
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    rank1 = to_megatron(state, layout, rank=1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(rank1, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    fc1 = to_megatron(state, layout, rank=1)["decoder.layers.0.mlp.linear_fc1.weight"]
    half = layout.intermediate // 2
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate[half:], up[half:]]))


@pytest.fixture(scope="module")
def one_process(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The FSDP backend's run of each model in this process."""
    return {
        name: tp_worker.run(
            models[name], "fsdp", tmp_path_factory.mktemp(f"fsdp-{name}") / "ckpt", critic=False
        )
        for name in ("qwen2", "qwen3", "llama")
    }


@dataclass(frozen=True)
class Run:
    model: Path
    fsdp: dict[str, Any]
    """The FSDP backend's run in one process."""
    ranks: list[dict[str, Any]]
    """Every rank's result of the Megatron run."""


@pytest.fixture(scope="module", params=list(RUNS))
def run(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    one_process: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    name, allocation, nproc = RUNS[request.param]
    out = tmp_path_factory.mktemp(request.param.replace(":", "-").replace(" ", "-"))
    torchrun(WORKER, [str(models[name]), str(out), allocation], nproc=nproc)
    return Run(
        models[name], one_process[name], [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    )


def test_the_logits_equal_the_hugging_face_models(run: Run) -> None:
    errors = [e for r in run.ranks for e in r["logit_errors"]]
    assert errors  # the last stage's ranks compared every sequence
    print(f"max |logits(megatron) - logits(hf)|: {max(errors):.3g}")
    assert max(errors) <= ATOL


def test_training_equals_the_fsdp_backend(run: Run) -> None:
    fsdp, rank0 = run.fsdp, run.ranks[0]
    for theirs, ours in zip(fsdp["stats"], rank0["stats"], strict=True):
        assert ours.keys() == theirs.keys() >= {"loss", "grad_norm", "entropy", "logp", "lr"}
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert all(r["stats"] == rank0["stats"] for r in run.ranks)
    assert all(r["state"] == {} for r in run.ranks[1:])
    diff = max_abs_diff(fsdp["state"], rank0["state"])
    print(f"max |param(fsdp) - param(megatron)| after {tp_worker.STEPS} steps: {diff:.3g}")
    assert diff <= tp_worker.PARAM_ATOL
    initial = AutoModelForCausalLM.from_pretrained(str(run.model), dtype=torch.float32)
    assert max_abs_diff(fsdp["state"], initial.state_dict()) > 1e-4  # it trained
    tp_worker.check_scores_match(fsdp, run.ranks, "logprobs", ATOL)


def test_a_megatron_checkpoint_resumes_exactly_and_exports(run: Run) -> None:
    tp_worker.check_resumes_exactly(run.ranks[0])


def test_megatron_weights_are_published_a_bucket_at_a_time(run: Run) -> None:
    tp_worker.check_published(run.ranks[0])


def test_the_knobs_act(tmp_path: Path, models: dict[str, Path]) -> None:
    # gradient_checkpointing: every layer runs forward again in backward, the same step
    torchrun(WORKER, ["knobs", str(models["qwen2"]), str(tmp_path)], nproc=1)
    knobs = torch.load(tmp_path / "knobs.pt")
    plain, recompute = knobs["plain"], knobs["recompute"]
    assert recompute["layer_forwards"] == 2 * plain["layer_forwards"] > 0
    assert recompute["stats"] == pytest.approx(plain["stats"], rel=1e-6)
    assert recompute["logprobs"] == plain["logprobs"]


def test_an_allocation_names_tensor_and_pipeline_sizes(tmp_path: Path) -> None:
    config = validate_config({"run": "r", "backend": "megatron:d1t2p2"})
    backend = config.backend_config("m")
    assert isinstance(backend, MegatronBackendConfig)
    strategy = backend.allocation.strategy
    assert (strategy.data, strategy.tensor, strategy.pipeline) == (1, 2, 2)
    with pytest.raises(ValueError, match="context parallel is not implemented"):
        validate_config({"run": "r", "backend": "megatron:c2"})
    unknown = r"backend\.attention: unknown key \(known here: type, allocation\)"
    with pytest.raises(ValueError, match=unknown):
        validate_config({"run": "r", "backend": {"type": "megatron", "attention": "sdpa"}})
    with pytest.raises(ValueError, match="trains a critic"):
        validate_config({"run": "r", "backend": "megatron", "algorithm": "ppo"})
    with pytest.raises(ValueError, match="fp32"):
        validate_config({"run": "r", "backend": "megatron", "optim": {"mixed_precision": "bf16"}})


def test_models_it_cannot_split_are_refused(models: dict[str, Path]) -> None:
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="1 key-value heads must divide by 2"):
        Layout.of(AutoConfig.from_pretrained(str(tiny_model_dir())), tensor=2)
    with pytest.raises(ValueError, match="3 layers do not divide by 2"):
        Layout.of(
            AutoConfig.from_pretrained(str(models["qwen2"])).__class__(num_hidden_layers=3),
            pipeline=2,
        )
    with pytest.raises(ValueError, match="builds qwen2, qwen3, llama"):
        Layout.of(AutoConfig.from_pretrained(str(tiny_model_dir(moe=True))))


def test_a_cpu_without_the_harness_is_refused(models: dict[str, Path]) -> None:
    # in a process of its own: this one never imports megatron-core
    script = f"""
import pytest, torch
from trainer.backends.megatron import MegatronBackend
from trainer.parallel.strategy import parse_allocation
with pytest.raises(ValueError, match="pipeline parallel needs untied"):
    MegatronBackend({str(models["llama"])!r}, allocation=parse_allocation("megatron:p2"))
if not torch.cuda.is_available():  # a GPU runs it for real (.ci/gpu-check.sh)
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs"):
        MegatronBackend({str(models["qwen2"])!r})
print("refused")
"""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused" in proc.stdout
