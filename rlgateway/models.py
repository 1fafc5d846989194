"""The model names the experiment spec and the launch spec take: `smollm2`, `tiny`, or a model
directory. The two built models are built on first use on the machine that asks (in
`engines.tiny_model.models_cache_dir()`), so each node of a cluster builds its own."""

from __future__ import annotations

import sys
from pathlib import Path


def resolve_model(name: str, base_dir: Path) -> Path:
    """`smollm2`, `tiny`, or a model directory (relative to `base_dir`)."""
    if name == "smollm2":
        from engines.smollm2 import smollm2_dir

        return smollm2_dir()
    if name == "tiny":
        from engines.tiny_model import tiny_model_dir

        return tiny_model_dir()
    p = Path(name) if Path(name).is_absolute() else base_dir / name
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model: {name!r} is not smollm2, tiny, or a model directory (no {p / 'config.json'})"
        )
    return p


if __name__ == "__main__":  # `python -m rlgateway.models NAME`: print its directory
    print(resolve_model(sys.argv[1], Path.cwd()))
