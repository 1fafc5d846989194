"""Trainer throughput and memory per rank under each parallel strategy, side by side in one run.

    .venv/bin/python bench/bench_parallel.py [--seqs 32] [--steps 4] [--rounds 3]
        [--token-budget 1024] [--cores 2] [--only ALLOC ...] [--logs DIR] [--model smollm2|DIR]

Each configuration is an allocation string on a demo-size tiny model: the dense model under
`fsdp` (1 process), `fsdp:d2` (2 processes, data parallel), `fsdp:t2` (tensor parallel) and
`fsdp:c2` (Ulysses context parallel), and the Megatron backend on the same model under
`megatron` (1 process), `megatron:t2` and `megatron:p2` (megatron-core's tensor and pipeline
parallel; on a CPU through the test harness tests/support/megatron_cpu.py, as its tests run);
the MoE model under `archon` (1 process) and `archon:e2` (2 processes, expert parallel; router
balance loss 0.01). `--model` puts another dense model (SmolLM2, a directory) in the dense
model's place; the MoE model stays the tiny one. Every configuration runs as a fresh
`torchrun` of this script (`--worker ALLOC MODEL OUT`) on the gloo backend, with `--cores`
threads in all (OMP_NUM_THREADS = cores / processes), and trains the same `--seqs` sequences
(`bench_trainer.make_sequences`: long-tailed lengths, token ids < 256), every rank given the whole
batch, packed into micro-batches of `--token-budget` tokens.

A worker builds the backend, runs one warmup step, then `--steps` timed steps (a barrier before
each; a step's time is the slowest rank's). It reports the median step time, tokens/s (all tokens
of the batch, prompt and response, over the median step time), the peak RSS of each rank
(`ru_maxrss`) and the bytes of parameters and AdamW state each rank holds (local shards of
DTensors), which is the figure sharding changes; and the warmup step's loss and gradient norm,
which should agree between configurations of one model (same weights, same batch). The driver
runs the configurations in interleaved rounds (each round starts every configuration once), so
that load from other processes falls on all alike, and reports medians over the rounds and, per
round, each configuration's throughput against the 1-process run of the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

VOCAB = 256
AUX_LOSS_COEF = 0.01


@dataclass(frozen=True, slots=True)
class Config:
    """One row of the table: an allocation on one of the two models, in `processes` processes."""

    allocation: str
    moe: bool
    processes: int
    label: str

    @property
    def model(self) -> str:
        return "moe" if self.moe else "dense"


CONFIGS = (
    Config("fsdp", False, 1, "1 process"),
    Config("fsdp:d2", False, 2, "data parallel"),
    Config("fsdp:t2", False, 2, "tensor parallel"),
    Config("fsdp:c2", False, 2, "Ulysses context parallel"),
    Config("megatron", False, 1, "megatron-core, 1 process"),
    Config("megatron:t2", False, 2, "megatron-core tensor parallel"),
    Config("megatron:p2", False, 2, "megatron-core pipeline parallel"),
    Config("archon", True, 1, "1 process"),
    Config("archon:e2", True, 2, "expert parallel"),
)
BASELINE = {"dense": "fsdp", "moe": "archon"}
"""The 1-process configuration each model's ratios are taken against."""


# ---------------------------------------------------------------------------------------------
# worker: one configuration, run under torchrun


def _local_bytes(t: Any) -> int:
    """Bytes of this rank's part of `t` (its local shard if a DTensor)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())


def state_bytes(backend: Any) -> int:
    """Bytes of parameters and optimizer state (AdamW's two moments) this rank holds."""
    import torch

    params = [p for group in backend.optimizer.param_groups for p in group["params"]]
    total = sum(_local_bytes(p) for p in params)
    for state in backend.optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def worker(allocation: str, model_dir: str, out: str, seqs_n: int, steps: int, budget: int) -> None:
    import torch
    import torch.distributed as dist

    from bench.bench_trainer import make_sequences
    from trainer.backends.registry import BACKEND_CLASSES
    from trainer.batch import MicroBatch
    from trainer.parallel.strategy import parse_allocation

    def loss_fn(
        logp_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        """-sum(logp * advantage) over trained tokens / normalizer: the plain policy gradient."""
        return -(logp_1T * mb.advantages_1T * mb.loss_mask_1T).sum() / normalizer, {}

    alloc = parse_allocation(allocation)
    if alloc.backend == "megatron" and not torch.cuda.is_available():
        from tests.support import megatron_cpu

        megatron_cpu.install()
    extra: dict[str, Any] = {"aux_loss_coef": AUX_LOSS_COEF} if alloc.backend == "archon" else {}
    t0 = time.perf_counter()
    backend: Any = BACKEND_CLASSES[alloc.backend](model_dir, lr=1e-5, allocation=alloc, **extra)
    build_s = time.perf_counter() - t0
    seqs = make_sequences(seqs_n, VOCAB, seed=0)
    norm = float(sum(s.num_loss_tokens for s in seqs))

    def step() -> dict[str, float]:
        stats: dict[str, float] = backend.train_step(
            seqs, loss_fn, temperature=1.0, token_budget=budget, global_norm=norm
        )
        return stats

    warm = step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mine = {
        "times": times,
        "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "state_bytes": state_bytes(backend),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        result = {
            "allocation": allocation,
            "strategy": str(backend.strategy),
            "world_size": dist.get_world_size(),
            "threads": torch.get_num_threads(),
            "tokens": sum(len(s) for s in seqs),
            "loss_tokens": int(norm),
            "build_s": build_s,
            # a step is done when its slowest rank is
            "step_s": [max(r["times"][k] for r in ranks) for k in range(steps)],
            "rss_kib": [r["rss_kib"] for r in ranks],
            "state_bytes": [r["state_bytes"] for r in ranks],
            "warmup_loss": warm["loss"],
            "warmup_grad_norm": warm["grad_norm"],
        }
        Path(out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# driver: every configuration in interleaved rounds, then the table


def run_config(
    config: Config, model_dir: str, args: argparse.Namespace, logs: Path, round_: int
) -> dict[str, Any]:
    """One fresh torchrun of `config`; its rank 0's result, or {"error": last lines of output}."""
    from engines.launch import free_port

    tag = f"{config.allocation.replace(':', '-')}.r{round_}"
    out = logs / f"{tag}.json"
    log = logs / f"{tag}.log"
    env = os.environ | {
        "OMP_NUM_THREADS": str(max(1, args.cores // config.processes)),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        ),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(config.processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(Path(__file__).resolve()), "--worker", config.allocation, model_dir, str(out),
        "--seqs", str(args.seqs), "--steps", str(args.steps),
        "--token-budget", str(args.token_budget),
    ]  # fmt: skip
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.timeout} s"
    wall = time.perf_counter() - t0
    if out.is_file():  # measured; a failure after rank 0 wrote its result is noted, not hidden
        result: dict[str, Any] = json.loads(out.read_text())
        exit_error = {} if rc == 0 else {"exit_error": f"exit {rc}: " + "\n".join(cause(log))}
        return result | {"wall_s": wall} | exit_error
    return {"error": f"exit {rc}: " + "\n".join(cause(log)), "wall_s": wall}


def cause(log: Path) -> list[str]:
    """The lines of a failed run's output that say why: its workers' own errors (a traceback, a
    C++ `terminate`), not torchrun's summary, else the last lines."""
    lines = log.read_text().strip().splitlines()
    keys = ("Traceback", "Error", "terminate", "what()", "Aborted", "exception")
    first = next((k for k, line in enumerate(lines) if any(w in line for w in keys)), None)
    return lines[first : first + 8] if first is not None else lines[-15:]


def warnings_in(logs: Path) -> list[str]:
    """The distinct warning lines the workers printed."""
    seen: dict[str, None] = {}
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text().splitlines():
            if "warn" in line.lower():
                seen.setdefault(line.strip()[:240], None)
    return list(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run, after a warmup")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--cores", type=int, default=2, help="threads per run, split over its ranks")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--only", nargs="*", help="allocations to run (default: all)")
    ap.add_argument("--logs", help="keep each run's output and result here (default: dropped)")
    ap.add_argument("--model", help="the dense model: smollm2 or a directory (default: tiny, demo)")
    ap.add_argument("--worker", nargs=3, metavar=("ALLOC", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        allocation, model_dir, out = args.worker
        worker(allocation, model_dir, out, args.seqs, args.steps, args.token_budget)
        return

    import torch

    from bench.bench_trainer import make_sequences
    from engines.tiny_model import TINY_SIZES, tiny_model_dir
    from rlgateway.models import resolve_model

    configs = [c for c in CONFIGS if not args.only or c.allocation in args.only]
    # built here, once, before any worker looks for them
    models = {
        "dense": str(
            resolve_model(args.model, Path.cwd())
            if args.model
            else tiny_model_dir(size="demo", seed=0)
        ),
        "moe": str(tiny_model_dir(size="demo", seed=0, moe=True)),
    }
    seqs = make_sequences(args.seqs, VOCAB, seed=0)
    tokens = sum(len(s) for s in seqs)
    loss_tokens = sum(s.num_loss_tokens for s in seqs)
    runs: dict[str, list[dict[str, Any]]] = {c.allocation: [] for c in configs}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            for c in configs:
                res = run_config(c, models[c.model], args, logs, r)
                runs[c.allocation].append(res)
                what = res.get("error", res.get("exit_error", "ok")).splitlines()[0]
                print(f"round {r + 1} {c.allocation}: {res['wall_s']:.0f} s, {what}", flush=True)
        warnings = warnings_in(logs)
    total = time.perf_counter() - started

    def median_step(res: dict[str, Any]) -> float:
        return float(statistics.median(res["step_s"]))

    size = TINY_SIZES["demo"]
    dense = f"dense: {args.model}; " if args.model else ""
    print(
        f"\n{dense}demo-size tiny models (hidden {size.hidden_size}, {size.num_hidden_layers} "
        f"layers; MoE: 8 experts, top 2), {args.seqs} sequences, {tokens} tokens per step "
        f"({loss_tokens} trained), token budget {args.token_budget}, torch {torch.__version__}, "
        f"gloo, {args.cores} threads per run (1 process: {args.cores} threads; 2 processes: "
        f"{max(1, args.cores // 2)} each); median of {args.steps} steps after a warmup, then "
        f"median of {args.rounds} interleaved rounds; {total:.0f} s in all\n"
    )
    print(
        "| model | allocation | strategy | processes | s/step | tokens/s | vs 1 process | "
        "peak RSS per rank (MiB) | params + AdamW per rank (MiB) | warmup loss | warmup grad norm |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in configs:
        ok = [res for res in runs[c.allocation] if "error" not in res]
        if not ok:
            print(f"| {c.model} | `{c.allocation}` | {c.label} | {c.processes} | failed |||||||")
            continue
        step_s = statistics.median(median_step(res) for res in ok)
        # per round, baseline / this: robust to load that changes from round to round
        ratios = [
            median_step(b) / median_step(res)
            for res, b in zip(runs[c.allocation], runs.get(BASELINE[c.model], []), strict=False)
            if "error" not in res and "error" not in b
        ]
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        rss = statistics.median(max(res["rss_kib"]) for res in ok) / 1024
        state = statistics.median(max(res["state_bytes"]) for res in ok) / 2**20
        warm = ok[0]
        print(
            f"| {c.model} | `{c.allocation}` | {c.label} ({warm['strategy']}) | {c.processes} | "
            f"{step_s:.2f} | {tokens / step_s:.0f} | {ratio} | {rss:.0f} | {state:.1f} | "
            f"{warm['warmup_loss']:.5f} | {warm['warmup_grad_norm']:.4f} |"
        )
    failures = [
        (alloc, k, res["error"])
        for alloc, results in runs.items()
        for k, res in enumerate(results)
        if "error" in res
    ]
    for alloc, k, error in failures:
        print(f"\n{alloc} failed in round {k + 1}:\n{error}")
    for alloc, results in runs.items():
        crashed = [k for k, res in enumerate(results) if "exit_error" in res]
        if crashed:
            rounds = ", ".join(str(k + 1) for k in crashed)
            print(
                f"\n{alloc} failed after it had written its result (counted above) in round(s) "
                f"{rounds} of {len(results)}; the first:\n{results[crashed[0]]['exit_error']}"
            )
    if warnings:
        print("\nwarnings the workers printed:")
        for line in warnings:
            print(f"  {line}")


if __name__ == "__main__":
    main()
