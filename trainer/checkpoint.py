"""Checkpoints that make training exactly-once across crashes.

`checkpoint_dir/step-000007/` holds the backend's state (model, optimizer, schedule, optimizer
steps), the critic's in `critic/` when one is trained (PPO), and `rlgateway.json`: the training
step, the policy version it publishes (step N's weights are version N unless a resume found the
engines serving a newer version, see `trainer.loop.Trainer.resume`), the base model
directory the run trained (whose config and tokenizer describe the weights; checkpoints written
before it was recorded lack it), and the ids of the sessions that step trained. It is written to
a `.tmp` directory and renamed, so a checkpoint exists whole or not at all. The order of a step
is: train, save the checkpoint, mark its sessions consumed, publish. A trainer killed between
saving and marking finds the ids in the newest checkpoint when it resumes and settles them as
consumed: nothing is trained twice. Killed before saving, the step never happened: its sessions
are still leased by the trainer's identity (stable per run), and the restarted trainer takes
them back at once (`Store.release_owner`). The steps after the newest checkpoint (with
`checkpoint_every` > 1, or every step before the first checkpoint) are lost with the trainer:
on resume their sessions go back to the queue (`Store.requeue_after`), so every trajectory ends
up trained exactly once into weights that survive.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.backends.base import TrainBackend, ValueBackend

META = "rlgateway.json"
CRITIC = "critic"
"""Subdirectory of a checkpoint with the critic's own backend state (PPO)."""


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    step: int
    consumed: list[str]
    """Sessions trained by this step."""
    dropped: dict[str, str]
    """Sessions left out on purpose while forming this step -> their outcome (stale,
    filtered, untrainable)."""
    model: str | None = None
    """The base model directory the run trained, absolute; None in a checkpoint written before
    it was recorded. `save` records the backend's."""
    version: int | None = None
    """The policy version this checkpoint's weights are published as; None: the step (a run
    whose trainer never resumed against a gateway that served a newer version)."""

    @property
    def policy_version(self) -> int:
        """The policy version this checkpoint's weights are published as."""
        return self.step if self.version is None else self.version


def _name(step: int) -> str:
    return f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete checkpoint directory (its `rlgateway.json` is written last)."""
    return (path / META).is_file()


def read_meta(path: Path) -> CheckpointMeta:
    """The meta of the checkpoint directory `path` (see `is_checkpoint`)."""
    data = json.loads((path / META).read_text())
    dropped = data.get("dropped", {})
    if isinstance(dropped, list):  # written before outcomes were recorded: all were stale drops
        dropped = dict.fromkeys(dropped, "stale")
    return CheckpointMeta(
        int(data["step"]),
        list(data["consumed"]),
        dict(dropped),
        data.get("model"),
        data.get("version"),
    )


def latest(root: Path) -> tuple[Path, CheckpointMeta] | None:
    """The newest complete checkpoint under `root`, if any."""
    if not root.is_dir():
        return None
    found = []
    for d in root.iterdir():
        if d.name.startswith("step-") and not d.name.endswith(".tmp") and is_checkpoint(d):
            found.append((d, read_meta(d)))
    if not found:
        return None
    return max(found, key=lambda x: x[1].step)


def save(
    root: Path,
    backend: TrainBackend,
    meta: CheckpointMeta,
    *,
    keep: int,
    is_writer: bool = True,
    critic: ValueBackend | None = None,
) -> Path:
    """Write the checkpoint of `meta.step` atomically (with the critic's state, if one is given,
    in its `critic/` subdirectory); keep the newest `keep`. The meta records `backend.model_dir`
    as the base model unless `meta.model` is set."""
    final = root / _name(meta.step)
    tmp = root / (_name(meta.step) + ".tmp")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    backend.save(tmp)
    if critic is not None:
        critic.save(tmp / CRITIC)
    if is_writer:
        model = meta.model or str(backend.model_dir.resolve())
        (tmp / META).write_text(
            json.dumps(
                {
                    "step": meta.step,
                    "version": meta.policy_version,
                    "model": model,
                    "consumed": meta.consumed,
                    "dropped": meta.dropped,
                }
            )
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        steps = sorted(
            (
                d
                for d in root.iterdir()
                if d.name.startswith("step-") and not d.name.endswith(".tmp")
            ),
            key=lambda d: d.name,
        )
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_critic(path: Path, critic: ValueBackend) -> None:
    """Restore the critic saved beside the policy in checkpoint `path`."""
    if not (path / CRITIC).is_dir():
        raise ValueError(
            f"checkpoint {path} holds no critic (it was written by a run without one): resume "
            "with the algorithm it was trained with, or start from a fresh checkpoint_dir"
        )
    critic.load(path / CRITIC)
