"""The demo's learning, shown honestly: the same `rlgateway demo` with training and without (the
control), one after the other on this machine, and a table of what each summary.json says.

    .venv/bin/python bench/bench_demo.py [--minutes 5] [--seed 0] [--out bench-demo] [-- demo flags]

Both runs start from the same cached warm start; the first run builds it if needed (its time is
not part of either row).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(out: Path, minutes: float, seed: int, extra: list[str], train: bool) -> dict[str, object]:
    cmd = [sys.executable, "-m", "rlgateway.cli", "demo", "--minutes", str(minutes)]
    cmd += ["--seed", str(seed), "--out", str(out), *([] if train else ["--no-train"]), *extra]
    subprocess.run(cmd, check=True)
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-demo")
    p.add_argument("extra", nargs="*", help="more `rlgateway demo` flags (after --)")
    args = p.parse_args()
    root = Path(args.out)
    rows = []
    for train in (True, False):
        out = root / ("train" if train else "control")
        s = run(out, args.minutes, args.seed, args.extra, train)
        rows.append(("GRPO" if train else "no training", s))
    print("\n| run | reward start | reward end | change | steps | episodes | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, s in rows:
        start, end = float(s["reward_start"]), float(s["reward_end"])  # type: ignore[arg-type]
        print(
            f"| {name} | {start:.3f} | {end:.3f} | {end - start:+.3f} | {s['steps']} | "
            f"{s['episodes']} | {float(s['seconds']):.0f} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
