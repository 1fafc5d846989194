"""What every training backend's optimizer step shares, however it computes its gradients.

The LR schedule (`LRSchedule`), the checks of `train_step`'s arguments, the update itself (a
non-finite grad norm skips it; the step counts either way), the step's stats (the loss callback's
stats merged over micro-batches and ranks, the loss summed), and the schedule's record in a
checkpoint (`trainer_state.json`: the step, the schedule, the scheduler's state, plus what a
backend adds), so that FSDP and Megatron resume alike. A checkpoint resumes under a schedule
whose LR curve is its own (`LRSchedule.curve`): a run may train on past its `max_steps` under a
constant schedule (after its warmup, if any), never where the decay would change.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.batch import TrainSequence
from trainer.stats import merge_stats

Schedule = Literal["constant", "linear", "cosine"]

STATE_FILE = "trainer_state.json"
"""Step and LR-schedule state, beside a backend's weight files in a checkpoint directory."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)  # no slots: LambdaLR checkpoints a schedule object's __dict__
class LRSchedule:
    """LR multiplier after `step` optimizer steps: linear warmup from 1/warmup_steps to 1 over
    `warmup_steps`, then `constant`, or `linear`/`cosine` decay to 0 at `total_steps`."""

    kind: Schedule
    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(
            1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        )
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def curve(self) -> dict[str, Any]:
        """What the multiplier at every step depends on: all of it, less `total_steps` under a
        constant schedule (which never decays)."""
        settings = asdict(self)
        if self.kind == "constant":
            del settings["total_steps"]
        return settings


StepRecord = tuple[int, float, dict[str, float]]
"""One micro-batch's (trained tokens, loss, the loss callback's stats)."""


def check_step(seqs: Sequence[TrainSequence], global_norm: float) -> None:
    """ValueError unless `train_step` has sequences and a positive normaliser."""
    if not seqs:
        raise ValueError("train_step needs at least one sequence")
    if global_norm <= 0:
        raise ValueError(f"global_norm must be positive, got {global_norm}")


def apply_update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_norm: float,
    step: int,
    step_schedule: bool,
) -> float:
    """The optimizer's step (skipped, with a warning, for a non-finite `grad_norm`: the weights
    stay usable), the gradients cleared, the schedule advanced with `step_schedule`; returns the
    LR the step used."""
    lr = float(optimizer.param_groups[0]["lr"])
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("step %d: grad norm is %s; skipping the update", step, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    if step_schedule:
        scheduler.step()
    return lr


def step_stats(records: Sequence[StepRecord], grad_norm: float, lr: float) -> dict[str, float]:
    """`train_step`'s result from every rank's micro-batch records: the callback's stats merged
    token-weighted, `loss` summed (each micro-batch's loss is its share of the batch's), then
    `grad_norm` and `lr`."""
    parts = [(n, {"loss": loss, **values}) for n, loss, values in records]
    return merge_stats(parts, summed={"loss"}) | {"grad_norm": grad_norm, "lr": lr}


def write_state(
    path: Path,
    step: int,
    schedule: LRSchedule,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    **extra: Any,
) -> None:
    """`path/trainer_state.json`: the step, the schedule and the scheduler's state, and `extra`."""
    state: dict[str, Any] = {"step": step, "schedule": asdict(schedule), **extra}
    state["scheduler"] = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (path / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def read_state(path: Path, schedule: LRSchedule) -> dict[str, Any]:
    """What `write_state` wrote in `path`; ValueError when it was written with a schedule of
    another curve (the resumed run's LR would jump). Only `total_steps` (the run's max_steps) may
    differ, and only under a constant schedule."""
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    saved = LRSchedule(**state["schedule"])
    if saved.curve() == schedule.curve():
        return state
    if replace(saved, total_steps=schedule.total_steps) == schedule:
        raise ValueError(
            f"checkpoint {path} was saved with a {saved.kind} LR schedule that decays to 0 at "
            f"step {saved.total_steps} (max_steps); resuming with {schedule.total_steps} would "
            f"change its curve: keep max_steps at {saved.total_steps} (only a constant schedule, "
            "after its warmup, lets a run train on past the max_steps it began with)"
        )
    raise ValueError(
        f"checkpoint {path} was saved with LR schedule {asdict(saved)}; this backend has "
        f"{asdict(schedule)}: construct it with the same schedule settings"
    )


def restore_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any]
) -> None:
    """The scheduler as `write_state` recorded it (its schedule function is the backend's)."""
    scheduler.load_state_dict(state["scheduler"] | {"lr_lambdas": [None]})
