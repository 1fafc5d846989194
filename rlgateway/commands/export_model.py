"""`rlgateway export-model SOURCE OUT_DIR`: a trained policy as a Hugging Face model directory.

SOURCE names a checkpoint in one of four ways: the checkpoint directory itself
(`checkpoint_dir/step-000042`), a run's `checkpoint_dir` (its newest complete checkpoint), a
`rlgateway demo --out` directory (its `checkpoints/`), or a run config YAML (its
`checkpoint_dir`, relative to the working directory as for `rlgateway train`). The export itself
is `trainer.export`; `rlgateway serve --model OUT_DIR` then serves it at its policy version.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rlgateway.errors import CLIError

if TYPE_CHECKING:
    from trainer.config import TrainConfig

DEMO_CHECKPOINTS = "checkpoints"
"""Where `rlgateway demo` keeps its checkpoints inside `--out`."""


def run_export_model(args: argparse.Namespace) -> int:
    from trainer import checkpoint
    from trainer.export import ExportError, export, find_checkpoint

    source = Path(args.source)
    model = Path(args.model) if args.model else None
    out = Path(args.out_dir)
    try:
        if source.suffix in (".yaml", ".yml") and source.is_file():
            cfg = _load_config(source)
            ckpt = find_checkpoint(Path(cfg.checkpoint_dir))
            if model is None and checkpoint.read_meta(ckpt).model is None:
                from rlgateway.build import model_dir_of

                # A checkpoint older than the recorded base model: the config says which.
                model = model_dir_of(cfg)
        elif source.is_dir() and _is_demo_out(source):
            ckpt = find_checkpoint(source / DEMO_CHECKPOINTS)
        else:
            ckpt = find_checkpoint(source)
        policy = export(ckpt, out, model=model, force=args.force)
    except ExportError as exc:
        raise CLIError(str(exc)) from exc
    print(
        f"exported step {policy.step} (policy version {policy.version}) of {ckpt} to {out}; "
        f"serve it with: rlgateway serve --model {out}"
    )
    return 0


def _is_demo_out(source: Path) -> bool:
    """A demo's `--out` directory: no checkpoint itself, with the demo's checkpoint_dir inside."""
    from trainer import checkpoint

    return (
        not checkpoint.is_checkpoint(source)
        and checkpoint.latest(source) is None
        and (source / DEMO_CHECKPOINTS).is_dir()
    )


def _load_config(path: Path) -> TrainConfig:
    from trainer.config import load_config

    try:
        return load_config(path)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
