"""`rlgateway model tiny DIR [--moe]`."""

from __future__ import annotations

import argparse

from rlgateway.errors import CLIError


def run_model(args: argparse.Namespace) -> int:
    from engines.tiny_model import TINY_SIZES, build_tiny_model

    if args.size not in TINY_SIZES:
        raise CLIError(f"--size must be one of {', '.join(TINY_SIZES)}, not {args.size!r}")
    if args.max_model_len < 64:
        raise CLIError(f"--max-model-len must be >= 64, got {args.max_model_len}")
    try:
        out = build_tiny_model(
            args.dir,
            seed=args.seed,
            size=args.size,
            max_model_len=args.max_model_len,
            moe=args.moe,
        )
    except FileExistsError as exc:
        raise CLIError(str(exc)) from exc
    kind = "tiny MoE model" if args.moe else "tiny model"
    print(f"built the {kind} ({args.size}, seed {args.seed}) in {out}")
    return 0
