"""`rlgateway demo`: the CPU demo (see rlgateway/demo/run.py for what runs)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlgateway.errors import CLIError

if TYPE_CHECKING:
    from rlgateway.demo.run import DemoOptions


def run_demo_command(args: argparse.Namespace) -> int:
    _check(args)
    from rlgateway.demo.run import run_demo, train_config

    out = Path(args.out)
    options = demo_options(args)
    if options.train:  # a bad override fails now, before the warm start and before any file
        try:
            train_config(options, "", "sqlite:///:memory:")
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
    import torch

    from engines.tiny_model import tiny_model_dir
    from rlgateway.demo.warmstart import WarmStartConfig, warm_start

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    if args.model:
        model_dir = Path(args.model)
        print(f"policy: {model_dir} (no warm start)")
    else:
        base = tiny_model_dir(size="demo", seed=args.seed)
        ws = WarmStartConfig(steps=args.warm_start_steps, seed=args.seed)
        print(
            "warm start: SFT on a sloppy teacher's demonstrations (2 to 8 characters whatever "
            f"was asked, lowercase only 60% of the time), {ws.steps} steps through the trainer's "
            "backend; RL then has to do better than its teacher"
        )
        t0 = time.perf_counter()
        model_dir, cached = warm_start(base, ws, progress=_sft_progress(ws.steps))
        how = "cached" if cached else f"{time.perf_counter() - t0:.0f} s"
        print(f"warm start: {model_dir} ({how})")
    options = dataclasses.replace(options, model_dir=model_dir)
    what = f"training with {args.algorithm}" if options.train else "no training (a control run)"
    print(
        f"demo: {args.minutes:g} min, {what}, {args.workers} concurrent groups of "
        f"{args.group_size} agents, seed {args.seed}"
    )
    summary = asyncio.run(run_demo(options))
    _print_summary(summary, out)
    return 0


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """The demo's options from its flags; the policy is `--model`, or the warm start's once it
    exists (`model_dir` is replaced then)."""
    from rlgateway.demo.run import DemoOptions

    return DemoOptions(
        model_dir=Path(args.model or "."),
        out=Path(args.out),
        train=not args.no_train,
        minutes=args.minutes,
        seed=args.seed,
        algorithm=args.algorithm,
        lr=args.lr,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        eta=args.eta,
        workers=args.workers,
        overrides=tuple(args.overrides),
        engine={
            "engine": args.engine,
            "engine_urls": args.engine_urls,
            "engine_launch": args.engine_launch,
            "vllm_python": args.vllm_python,
            "sglang_python": args.sglang_python,
        },
    )


def _check(args: argparse.Namespace) -> None:
    if args.minutes <= 0:
        raise CLIError("--minutes must be positive (e.g. --minutes 5)")
    if args.group_size < 2:
        raise CLIError("--group-size must be at least 2: GRPO compares answers within a group")
    for name in ("groups_per_step", "workers", "warm_start_steps"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1")
    if args.lr < 0:
        raise CLIError("--lr must be >= 0")
    if args.engine != "local":
        if not args.model:
            raise CLIError(f"--engine {args.engine} needs --model DIR: the model its servers serve")
        if not args.engine_urls and not args.engine_launch:
            raise CLIError(f"--engine {args.engine} needs --engine-url URL (or --engine-launch)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"{args.model} is not a Hugging Face model directory (no config.json)")
    from trainer.algorithms.config import PRESETS

    if args.algorithm not in PRESETS:
        raise CLIError(f"unknown --algorithm {args.algorithm!r}; choose from {sorted(PRESETS)}")


def _sft_progress(total: int) -> Callable[[int, float], None]:
    every = max(1, total // 5)

    def report(step: int, nll: float) -> None:
        if step % every == 0 or step == total:
            print(f"  sft step {step}/{total}  nll {nll:.3f}", flush=True)

    return report


def _print_summary(s: dict[str, object], out: Path) -> None:
    shown = {k: s[k] for k in ("reward_start", "reward_end", "steps", "seconds", "trained")}
    print("\nsummary:", json.dumps(shown))
    print(f"reward curve: {s['png']}\nsummary:      {out / 'summary.json'}")
    exe = _rlgateway()
    store = f"--database-url {s['database_url']}"
    if s["checkpoints"] and s["steps"]:
        model = out / "model"
        print(
            f"the trained policy (step {s['steps']}) as a Hugging Face model directory:\n"
            f"  {exe} export-model {s['checkpoints']} {model}\n"
            "serve it at its version, recording into the demo's store:\n"
            f"  {exe} serve --model {model} {store}"
        )
    print(
        f"open the run: {exe} serve {store} --model {s['model']}\n"
        f"              then GET /runs/{s['run_id']} (admin token) or open the web page it prints"
    )


def _rlgateway() -> str:
    """The command as this interpreter's venv has it, so a pasted line runs this install."""
    import shutil
    import sys

    beside = Path(sys.executable).with_name("rlgateway")
    if beside.is_file():
        return str(beside)
    return shutil.which("rlgateway") or f"{sys.executable} -m rlgateway.cli"
