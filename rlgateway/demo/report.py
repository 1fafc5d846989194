"""What the demo shows: a live table while it runs, then a reward curve (PNG) and summary.json.

Rows come from the agent side (every `window` rewarded episodes), so a run with training and one
without are measured the same way: the mean reward of the answers the agents actually received.
The trainer's latest step (loss, staleness, tokens/s) is joined in when training.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rlgateway.demo.harness import Episode


@dataclass(frozen=True, slots=True)
class Row:
    seconds: float
    episodes: int
    reward: float
    """Mean reward of this window's episodes."""
    version: int
    """Newest policy version among this window's episodes."""
    tokens_per_s: float
    """Generated tokens per second over this window."""
    step: int
    """Training steps done (0 when not training)."""
    staleness: float
    """Mean staleness of the last step's trained tokens (versions)."""
    loss: float | None


@dataclass
class Progress:
    window: int
    out: TextIO = field(default_factory=lambda: sys.stdout)
    rows: list[Row] = field(default_factory=list)
    episodes: int = 0
    generated_tokens: int = 0
    _pending: list[Episode] = field(default_factory=list)
    _last_t: float = 0.0
    _train: dict[str, Any] = field(default_factory=dict)

    HEADER = (
        f"{'time':>6} {'episodes':>8} {'reward':>7} {'version':>7} {'step':>5} "
        f"{'stale':>5} {'loss':>8} {'tok/s':>7}"
    )

    def start(self) -> None:
        print(self.HEADER, file=self.out, flush=True)

    def on_train_step(self, row: dict[str, Any]) -> None:
        self._train = row

    def on_episode(self, ep: Episode) -> None:
        self.episodes += 1
        self.generated_tokens += ep.completion_tokens
        self._pending.append(ep)
        if len(self._pending) >= self.window:
            self._emit()

    def _emit(self) -> None:
        eps, self._pending = self._pending, []
        t = eps[-1].t
        dt = max(t - self._last_t, 1e-9)
        self._last_t = t
        loss = self._train.get("loss")
        row = Row(
            seconds=t,
            episodes=self.episodes,
            reward=statistics.fmean(e.reward for e in eps),
            version=max(e.version for e in eps),
            tokens_per_s=sum(e.completion_tokens for e in eps) / dt,
            step=int(self._train.get("step", 0)),
            staleness=float(self._train.get("staleness_mean", 0.0)),
            loss=float(loss) if loss is not None else None,
        )
        self.rows.append(row)
        loss_text = f"{row.loss:8.4f}" if row.loss is not None else f"{'-':>8}"
        print(
            f"{row.seconds:6.0f} {row.episodes:8d} {row.reward:7.3f} {row.version:7d} "
            f"{row.step:5d} {row.staleness:5.2f} {loss_text} {row.tokens_per_s:7.0f}",
            file=self.out,
            flush=True,
        )


def summarize(rows: list[Row], *, trained: bool, seconds: float, steps: int) -> dict[str, Any]:
    """`reward_start`: mean reward of the first tenth of the episodes (the warm-started policy,
    before training has had much effect); `reward_end`: of the last fifth. Each is taken over
    whole windows, at least one."""
    k_start = max(1, len(rows) // 10)
    k_end = max(1, len(rows) // 5)
    start = statistics.fmean(r.reward for r in rows[:k_start]) if rows else 0.0
    end = statistics.fmean(r.reward for r in rows[-k_end:]) if rows else 0.0
    return {
        "reward_start": start,
        "reward_end": end,
        "steps": steps,
        "seconds": seconds,
        "trained": trained,
        "episodes": rows[-1].episodes if rows else 0,
        "curve": [asdict(r) for r in rows],
    }


def rolling(values: list[float], n: int) -> list[float]:
    """Mean of the last `n` values (fewer at the start) at each index."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def write_outputs(out_dir: Path, summary: dict[str, Any], title: str) -> Path:
    """summary.json and reward.png into `out_dir`; returns the PNG's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = out_dir / "reward.png"
    plot_curve(summary["curve"], png, title=title)
    return png


def plot_curve(curve: list[dict[str, Any]], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    xs = [r["seconds"] / 60 for r in curve]
    rewards = [r["reward"] for r in curve]
    ax.plot(xs, rewards, ".", color="tab:blue", alpha=0.25, markersize=3, label="one window")
    smooth = max(1, len(curve) // 20)
    ax.plot(
        xs,
        rolling(rewards, smooth),
        color="tab:blue",
        linewidth=2,
        label=f"mean of {smooth} windows",
    )
    ax.set_xlabel("minutes")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)
    if any(r["step"] for r in curve):
        ax2 = ax.twinx()
        ax2.plot(xs, [r["version"] for r in curve], color="tab:gray", alpha=0.5, linewidth=1)
        ax2.set_ylabel("policy version", color="tab:gray")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
