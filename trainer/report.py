"""Where each training step's metrics go: metrics.jsonl, TensorBoard, W&B, and a report callback.

Only the leader rank emits. TensorBoard and W&B are imported lazily (never at module import); W&B
is optional and imported when the sink is built, so a run that asks for it without it installed
fails before training, with the command that fixes it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig

log = logging.getLogger(__name__)


def _wandb_run_id(run: str) -> str | None:
    """A W&B run id from the training run's id, so a resumed trainer continues the same W&B run."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run) if run else None


class MetricsSink:
    def __init__(
        self, cfg: TrainConfig, root: Path, report: Callable[[dict[str, Any]], None]
    ) -> None:
        self.cfg = cfg
        self.root = root
        self.report = report
        self.metrics_path = root / "metrics.jsonl"
        self.tensorboard = cfg.tensorboard
        self._tb: Any = None
        self._wandb: Any = None
        self._wandb_module: Any = None
        if cfg.wandb is not None:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(
                    "W&B logging is configured (the run config's `wandb` section) but wandb is "
                    "not installed: pip install wandb (or remove the wandb section)"
                ) from exc
            self._wandb_module = wandb

    def emit(self, row: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {
            k: v
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
        }
        if self.tensorboard:
            self._tensorboard(scalars, row["step"])
        if self.cfg.wandb is not None:
            self._wandb_log(scalars, row["step"])
        self.report(row)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _tensorboard(self, scalars: dict[str, float], step: int) -> None:
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("tensorboard is not installed: pip install tensorboard for event files")
                self.tensorboard = False
                return
            self._tb = SummaryWriter(str(self.root / "tb"))
        for k, v in scalars.items():
            self._tb.add_scalar(f"train/{k}", v, step)
        self._tb.flush()

    def _wandb_log(self, scalars: dict[str, float], step: int) -> None:
        w = self.cfg.wandb
        assert w is not None
        if self._wandb is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._wandb = self._wandb_module.init(
                project=w.project,
                entity=w.entity,
                name=w.name or self.cfg.run or None,
                id=_wandb_run_id(self.cfg.run),
                resume="allow",
                mode=w.mode,
                dir=str(self.root),
                config=self.cfg.model_dump(mode="json"),
            )
        self._wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
