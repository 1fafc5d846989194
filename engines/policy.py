"""Which policy version a model directory's weights are: the `rlgateway_policy.json` beside them.

`rlgateway export-model` writes a trained checkpoint as a Hugging Face model directory and
records there the policy version that checkpoint published (`PolicyFile`). An engine started on
such a directory serves that version: the tokens it samples before any weight update carry it,
so trajectories recorded against a served export say which policy sampled them. A directory
without the file (a base model) is version 0. Both the local engine and the vLLM/SGLang adapters
take the version from here; this module imports neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

POLICY_FILE = "rlgateway_policy.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyFile:
    """What `rlgateway_policy.json` holds. `version` >= 0 is the policy version the weights
    were published as, `step` the training step that produced them, `source` the checkpoint
    directory they were exported from."""

    version: int
    step: int
    source: str

    def write(self, model_dir: Path) -> None:
        (model_dir / POLICY_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_policy(model_dir: Path) -> PolicyFile | None:
    """The policy file of `model_dir`, or None where it has none. Raises ValueError, naming the
    file, for one that is not what `PolicyFile.write` writes."""
    path = model_dir / POLICY_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        policy = PolicyFile(
            version=int(data["version"]), step=int(data["step"]), source=str(data["source"])
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a policy file ({exc!r}): it must be a JSON object with integer "
            '"version" and "step" and a "source"; fix it or delete it'
        ) from exc
    if policy.version < 0:
        raise ValueError(f"{path}: version must be >= 0, got {policy.version}")
    return policy


def served_version(model_dir: Path, override: int | None = None) -> int:
    """The policy version an engine serving `model_dir` starts at: `override` when given, else
    the directory's policy file version, else 0."""
    if override is not None:
        return override
    policy = read_policy(model_dir)
    return policy.version if policy is not None else 0
