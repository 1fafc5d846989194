"""An experiment's outputs in its folder: `metrics.jsonl` (the trainer's step rows and the
evaluation rows, whose keys begin with `eval`), TensorBoard event files under `tb/`, the curve
`curve.png` and `summary.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Report:
    def __init__(self, out: Path, *, tensorboard: bool = True) -> None:
        self.out = out
        self.path = out / "metrics.jsonl"
        self._tensorboard = tensorboard
        self._tb: Any = None

    def rows(self) -> list[dict[str, Any]]:
        """Every row written so far (a resumed experiment's earlier ones too)."""
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def write(self, row: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tensorboard:
            self._scalars(row)

    def _scalars(self, row: dict[str, Any]) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out / "tb"))
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                tag = f"eval/{k}" if k.startswith("eval") else f"train/{k}"
                self._tb.add_scalar(tag, v, row["step"])
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def curve(self, title: str) -> Path:
        """The held-out accuracy (and mean reward at temperature) by step, with the training
        reward beside it."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        evals = [r for r in rows if "eval_rows" in r]
        train = [r for r in rows if "reward_mean" in r and "eval_rows" not in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (
            ("eval_accuracy", "held-out greedy accuracy"),
            ("eval_reward_mean", "held-out mean reward (sampled)"),
        ):
            pts = [(r["step"], r[key]) for r in evals if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=False), marker="o", label=label)
        if train:
            ax.plot(
                [r["step"] for r in train],
                [r["reward_mean"] for r in train],
                alpha=0.5,
                label="training reward (batch mean)",
            )
        ax.set_xlabel("training step")
        ax.set_ylabel("reward / accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        path = self.out / "curve.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        evals = [r for r in self.rows() if "eval_rows" in r]
        out: dict[str, Any] = dict(extra)
        if evals:
            first, last = evals[0], evals[-1]
            out["eval"] = {
                "first_step": first["step"],
                "last_step": last["step"],
                **{f"first_{k}": v for k, v in first.items() if k.startswith("eval_")},
                **{f"last_{k}": v for k, v in last.items() if k.startswith("eval_")},
            }
        (self.out / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
        return out
