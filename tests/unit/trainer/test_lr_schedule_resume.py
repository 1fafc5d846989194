"""A checkpoint's LR schedule record (`trainer.backends.update`): a run resumes under the curve it
was saved with; under a constant schedule (after its warmup) it may train on past the
`max_steps` it began with, and the resumed LR goes on as it would have; where the curve decays
over max_steps (linear, cosine) a changed max_steps is refused, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.backends.update import (
    LRSchedule,
    Schedule,
    read_state,
    restore_scheduler,
    write_state,
)

LR = 0.1


def scheduler_of(schedule: LRSchedule) -> torch.optim.lr_scheduler.LambdaLR:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def saved_after(path: Path, schedule: LRSchedule, steps: int) -> None:
    scheduler = scheduler_of(schedule)
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
    write_state(path, steps, schedule, scheduler)


def lrs(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [0, 3])
def test_a_constant_schedule_resumes_with_a_larger_max_steps(tmp_path: Path, warmup: int) -> None:
    saved_after(tmp_path, LRSchedule("constant", warmup, 5), steps=5)
    longer = LRSchedule("constant", warmup, 12)
    state = read_state(tmp_path, longer)
    assert state["step"] == 5
    resumed = scheduler_of(longer)
    restore_scheduler(resumed, state)
    assert lrs(resumed, 7) == pytest.approx([LR] * 7)
    # the same curve as a run that had max_steps 12 from its start
    assert lrs(scheduler_of(longer), 12)[5:] == pytest.approx([LR] * 7)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_a_decaying_schedule_refuses_another_max_steps_saying_why(
    tmp_path: Path, kind: Schedule
) -> None:
    saved_after(tmp_path, LRSchedule(kind, 1, 5), steps=3)
    assert read_state(tmp_path, LRSchedule(kind, 1, 5))["step"] == 3
    with pytest.raises(ValueError, match=rf"{kind} LR schedule that decays to 0 at step 5") as err:
        read_state(tmp_path, LRSchedule(kind, 1, 10))
    assert "keep max_steps at 5" in str(err.value)


@pytest.mark.parametrize(
    "other",
    [LRSchedule("linear", 0, 5), LRSchedule("constant", 2, 5), LRSchedule("constant", 2, 9)],
)
def test_another_curve_is_refused(tmp_path: Path, other: LRSchedule) -> None:
    saved_after(tmp_path, LRSchedule("constant", 0, 5), steps=2)
    with pytest.raises(ValueError, match="was saved with LR schedule"):
        read_state(tmp_path, other)
