"""A "new policy" for weight-update tests: a model's weights, each moved by seeded noise."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def perturbed(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The safetensors weights of `model_dir`, each plus `scale` times seeded normal noise."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def perturbed_dir(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of the model directory `model_dir` at `out` with `perturbed` weights."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    state = perturbed(model_dir, seed)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
