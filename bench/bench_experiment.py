"""An example experiment's learning, shown honestly: training runs on several seeds and the
no-train control (the same spec with `optim.lr=0`: rollouts, steps and evaluations as in training,
weights unchanged), one after the other on this machine; a table of each run's held-out greedy
accuracy at every evaluation, and one figure of all the curves.

    .venv/bin/python bench/bench_experiment.py examples/math/math.yaml --seeds 0 1 --control \\
        --out bench-math [KEY=VALUE ...]
    .venv/bin/python bench/bench_experiment.py --collect bench-math/seed0 bench-math/control

`--collect` only reads finished runs' folders (metrics.jsonl, summary.json; a run stopped early
has no summary.json and is read from its metrics alone). A run's seed sets the trainer's seed
(`optim.seed`) and the data order (`dataset.seed`). A second table reads each evaluation's
episodes out of the run's own store (`store.db`, the embedded gateway's): how many held-out
problems were solved at the first, second, ... answer (the first turn with a positive reward),
and how many answers the `max_tokens` cap cut, at each answer position. A third reads the
trained episodes: per five steps, the answers the cap cut and those that finished, and how
many of each the grader paid (before `algo.zero_truncated_reward` takes a cut answer's reward).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def run(spec: str, out: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "rlgateway.cli", "run", spec, "--out", str(out), *overrides]
    subprocess.run(cmd, check=True)


def read(out: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    evals = [r for r in rows if "eval_rows" in r]
    train = [r for r in rows if "reward_mean" in r and "eval_rows" not in r]
    path = out / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
    else:  # stopped before its end: what its metrics say
        summary = {
            "steps": max((r["step"] for r in train), default=0),
            "episodes": sum(int(r.get("trajectories", 0)) for r in train),
            "failures": {},
            "seconds": float("nan"),
        }
    return {"name": out.name, "evals": evals, "train": train, "summary": summary}


async def _answers(out: Path) -> dict[int, dict[str, Counter[int]]]:
    """Per evaluation step: `solved`, problems by the answer (1, 2, ...) first rewarded, 0 for
    never; `cut`, answers by position that `max_tokens` cut."""
    from store.store import Store
    from store.types import SessionFilter

    eval_run = json.loads((out / "experiment.json").read_text())["eval_run_id"]
    store = await Store.connect(f"sqlite:///{(out / 'store.db').resolve()}", upgrade=False)
    steps: dict[int, dict[str, Counter[int]]] = {}
    try:
        async for detail, _ in store.export_sessions(eval_run, SessionFilter()):
            meta = detail.info.metadata
            assert isinstance(meta, dict)
            ids = [c for seg in detail.segments for c in seg.completion_ids]
            paid = {r.completion_id for r in detail.rewards if r.value > 0}
            final = any(r.value > 0 and r.completion_id is None for r in detail.rewards)
            at = next((k + 1 for k, c in enumerate(ids) if c in paid), len(ids) if final else 0)
            row = steps.setdefault(int(meta["eval_step"]), {"solved": Counter(), "cut": Counter()})
            row["solved"][at] += 1
            for k, c in enumerate(ids):
                row["cut"][k + 1] += detail.finish_reasons.get(c) == "length"
    finally:
        await store.close()
    return steps


async def _trained(out: Path) -> dict[int, Counter[str]]:
    """Per block of `BLOCK` training steps: the trained episodes' answers, `cut` (finish reason
    length) or `finished`, and how many of each the grader paid (`cut paid`, `finished paid`: a
    turn reward above 0, or the final reward on the last answer), whatever the trainer then
    made of the reward (`algo.zero_truncated_reward` takes a cut answer's)."""
    from store.store import Store
    from store.types import SessionFilter

    run_id = json.loads((out / "experiment.json").read_text())["run_id"]
    store = await Store.connect(f"sqlite:///{(out / 'store.db').resolve()}", upgrade=False)
    blocks: dict[int, Counter[str]] = {}
    try:
        async for detail, _ in store.export_sessions(run_id, SessionFilter()):
            step = detail.info.consumed_step
            if step is None or step < 1:
                continue
            ids = [c for seg in detail.segments for c in seg.completion_ids]
            paid = {r.completion_id for r in detail.rewards if r.value > 0}
            if ids and any(r.value > 0 and r.completion_id is None for r in detail.rewards):
                paid.add(ids[-1])
            n = blocks.setdefault((step - 1) // BLOCK, Counter())
            n["last step"] = max(n["last step"], step)
            for c in ids:
                kind = "cut" if detail.finish_reasons.get(c) == "length" else "finished"
                n[kind] += 1
                n[f"{kind} paid"] += c in paid
    finally:
        await store.close()
    return blocks


BLOCK = 5
"""Training steps per row of the trained-answers table."""


def trained_table(folders: list[Path]) -> str:
    """The training batches' answers, cut or finished, and those the grader paid."""
    read_out = {f: asyncio.run(_trained(f)) for f in folders if (f / "store.db").exists()}
    lines = [
        "| run | steps | answers cut by max_tokens (graded right) | finished (graded right) |",
        "|---|---|---|---|",
    ]
    for folder, blocks in read_out.items():
        for b, n in sorted(blocks.items()):
            lines.append(
                f"| {folder.name} | {b * BLOCK + 1}-{n['last step']} | {n['cut']} "
                f"({n['cut paid']}) | {n['finished']} ({n['finished paid']}) |"
            )
    return "\n".join(lines)


def answers_table(folders: list[Path]) -> str:
    """Each evaluation's problems by the answer that first solved them, and the cut answers."""
    read_out = {f: asyncio.run(_answers(f)) for f in folders if (f / "store.db").exists()}
    lines = [
        "| run | step | problems | solved at answer 1 / 2 / ... | never | "
        "cut by max_tokens at answer 1 / 2 / ... |",
        "|---|---|---|---|---|---|",
    ]
    for folder, steps in read_out.items():
        n = max((k for r in steps.values() for k in r["cut"]), default=1)
        for step, r in sorted(steps.items()):
            solved = " / ".join(str(r["solved"][k]) for k in range(1, n + 1))
            cut = " / ".join(str(r["cut"][k]) for k in range(1, n + 1))
            total = sum(r["solved"].values())
            lines.append(
                f"| {folder.name} | {step} | {total} | {solved} | {r['solved'][0]} | {cut} |"
            )
    return "\n".join(lines)


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | steps | episodes | failed | minutes | accuracy by step (greedy, held out) | "
        "first | last | change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ev, s = r["evals"], r["summary"]
        curve = ", ".join(f"{e['step']}: {e['eval_accuracy']:.3f}" for e in ev)
        first, last = ev[0]["eval_accuracy"], ev[-1]["eval_accuracy"]
        lines.append(
            f"| {r['name']} | {s['steps']} | {s['episodes']} | {sum(s['failures'].values())} | "
            f"{s['seconds'] / 60:.1f} | {curve} | {first:.3f} | {last:.3f} | "
            f"{100 * (last - first):+.1f} pts |"
        )
    return "\n".join(lines)


def figure(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(
            [e["step"] for e in r["evals"]],
            [e["eval_accuracy"] for e in r["evals"]],
            marker="o",
            label=r["name"],
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", nargs="?", help="the experiment spec")
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--control", action="store_true", help="also the no-train control (seed 0)")
    p.add_argument("--out", default="bench-experiment")
    p.add_argument("--collect", nargs="*", help="only tabulate these finished runs' folders")
    p.add_argument("--figure", help="write the curves here (default OUT/accuracy.png)")
    args, overrides = p.parse_known_args()
    root = Path(args.out)
    if args.collect:
        folders = [Path(x) for x in args.collect]
    else:
        if not args.spec:
            p.error("give a spec, or --collect folders")
        folders = []
        for seed in args.seeds:
            out = root / f"seed{seed}"
            run(args.spec, out, [f"optim.seed={seed}", f"dataset.seed={seed}", *overrides])
            folders.append(out)
        if args.control:
            out = root / "control"
            run(args.spec, out, ["optim.lr=0", "optim.seed=0", "dataset.seed=0", *overrides])
            folders.append(out)
    runs = [read(f) for f in folders]
    print(table(runs))
    print()
    print(answers_table(folders))
    print()
    print(trained_table(folders))
    fig = Path(args.figure) if args.figure else root / "accuracy.png"
    fig.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, fig, args.spec or "held-out accuracy")
    print(f"\nfigure: {fig}")


if __name__ == "__main__":
    main()
