"""The demo's warm start: a short supervised phase (SFT through the trainer's own backend) on the
sloppy teacher's demonstrations, so that the tiny model knows the task's format before RL.

The result is an ordinary HF model directory, cached by everything that determines it (base
model, seed, task version, steps, batch, learning rate), so a second demo run
starts in seconds. The same arguments give the same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlgateway.demo.task import TASK_VERSION, Problem, all_problems, teacher_answer


@dataclass(frozen=True, slots=True)
class WarmStartConfig:
    steps: int = 200
    """SFT optimizer steps: enough for the tiny model to imitate its teacher's mix of lengths and
    of all-lowercase answers (60 were not: BENCHMARKS.md, "The demo")."""
    batch_size: int = 64
    """Demonstrations per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    seed: int = 0
    """Seeds the demonstrations and torch."""


def cache_dir(base_model: Path, cfg: WarmStartConfig) -> Path:
    """Where the warm start of `base_model` under `cfg` lives (beside the base model)."""
    key = json.dumps(
        {"base": str(base_model.resolve()), "task": TASK_VERSION, **asdict(cfg)}, sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return base_model.parent / f"{base_model.name}-warm-{digest}"


def warm_start(
    base_model: Path,
    cfg: WarmStartConfig,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Path, bool]:
    """The warm-started model directory, built now or taken from the cache: (dir, was_cached).
    `progress(step, nll)` is called after every SFT step that runs."""
    out = cache_dir(base_model, cfg)
    if (out / "model.safetensors").is_file():
        return out, True
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _train(base_model, tmp / "model", cfg, progress)
        try:
            (tmp / "model").rename(out)
        except OSError:
            if not (out / "model.safetensors").is_file():  # not a concurrent build: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, False


def demonstrations(
    tok: Any, problems: list[Problem], cfg: WarmStartConfig
) -> list[list[tuple[list[int], list[int]]]]:
    """Per step, `batch_size` (prompt ids, completion ids) pairs from the teacher."""
    from engines.tiny_model import EOS_TOKEN

    rng = random.Random(cfg.seed)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    prompts = {
        p.id: tok.apply_chat_template(
            [{"role": "user", "content": p.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in problems
    }
    steps = []
    for _ in range(cfg.steps):
        batch = []
        for _ in range(cfg.batch_size):
            p = rng.choice(problems)
            answer = teacher_answer(p, rng)
            completion = [*tok.encode(answer, add_special_tokens=False), eos]
            batch.append((list(prompts[p.id]), completion))
        steps.append(batch)
    return steps


def _train(
    base_model: Path,
    out: Path,
    cfg: WarmStartConfig,
    progress: Callable[[int, float], None] | None,
) -> None:
    from engines.tiny_model import load_tokenizer
    from engines.weights import save_model_dir
    from trainer.backends.config import FSDPBackendConfig
    from trainer.backends.registry import build_backend
    from trainer.sft import SFTExample, sft_step

    backend = build_backend(
        FSDPBackendConfig(
            model_dir=str(base_model), lr=cfg.lr, total_steps=cfg.steps, seed=cfg.seed
        )
    )
    data = demonstrations(load_tokenizer(base_model), all_problems(), cfg)
    for i, batch in enumerate(data):
        stats = sft_step(backend, [SFTExample(p, c) for p, c in batch])
        if progress is not None:
            progress(i + 1, stats["nll"])
    save_model_dir(backend.full_state_dict(), out, base_model)
