"""The launch spec: the whole topology in one YAML file, `rlgateway launch SPEC --ray ADDRESS`.

    name: grpo-fleet            # the run: created on the first launch, trained again after
    database_url: postgresql://user@db:5432/rl
    model: tiny                 # tiny, smollm2, or a model directory every node can read
    work_dir: /shared/grpo      # checkpoints and published weights: storage every node sees
    gateways: {replicas: 2, resources: {CPU: 1}}
    engines: {kind: vllm, per_gateway: 1, resources: {GPU: 1}}   # none: local engines
    trainer:
      nnodes: 1
      nproc_per_node: 2
      resources: {CPU: 2}       # one bundle per node of the trainer's placement group
      config: {batch_size: 8, group_size: 4, max_steps: 100}   # the run config

`trainer.config` is the run config exactly as `rlgateway train --config` reads it (and as
`POST /runs` stores it); the launch fills in what the topology decides: `run`, `database_url`,
`model` and `checkpoint_dir` (default `work_dir/checkpoints`; made absolute). Checked whole
when read, with messages that name the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer.config import (
    TrainConfig,
    apply_overrides,
    describe_error,
    read_yaml_mapping,
    validate_config,
)

Resources = dict[str, float]
"""Ray resources: `CPU`, `GPU` and any custom resource the cluster's nodes declare."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _check_resources(value: Resources) -> Resources:
    bad = [k for k, v in value.items() if v < 0]
    if bad:
        raise ValueError(f"resources must not be negative: {', '.join(bad)}")
    return value


class GatewaysSpec(_Spec):
    replicas: int = Field(1, ge=1, le=64)
    """`rlgateway serve` processes, each anywhere on the cluster, all on `database_url`."""
    port: int = Field(0, ge=0, le=65535)
    """0: a free port on the replica's node, chosen once and kept when it is restarted."""
    resources: Resources = Field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources per replica."""
    args: list[str] = Field(default_factory=list)
    """More `rlgateway serve` flags (e.g. `--max-batch 32`)."""
    env: dict[str, str] = Field(default_factory=dict)

    _resources = field_validator("resources")(_check_resources)


class EnginesSpec(_Spec):
    kind: Literal["vllm", "sglang"]
    per_gateway: int = Field(1, ge=1, le=64)
    """Servers per gateway replica: each replica's router spreads its turns over its own."""
    python: str | None = None
    """The interpreter of the engine's own environment (default: `python3` on the node)."""
    resources: Resources = Field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources per server (`GPU: 1` for one GPU each)."""
    args: list[str] = Field(default_factory=list)
    """More server flags, appended last."""
    env: dict[str, str] = Field(default_factory=dict)

    _resources = field_validator("resources")(_check_resources)


class TrainerSpec(_Spec):
    nnodes: int = Field(1, ge=1, le=1024)
    """Nodes of the trainer's placement group (one bundle and one torchrun each)."""
    nproc_per_node: int = Field(1, ge=1, le=64)
    """torchrun ranks per node."""
    resources: Resources = Field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources per node's bundle (e.g. `{GPU: 8, CPU: 32}`)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The run config, as `rlgateway train --config` reads it."""
    env: dict[str, str] = Field(default_factory=dict)

    _resources = field_validator("resources")(_check_resources)


class LaunchSpec(_Spec):
    name: str = Field(min_length=1, max_length=100)
    """The run's name: the launch trains the newest run of this name, creating it if none."""
    database_url: str = Field(pattern=r"^postgresql(\+\w+)?://")
    """The one PostgreSQL database every gateway replica and the trainer use."""
    model: str = "tiny"
    """`tiny` and `smollm2` are built on each node; any other value is a model directory that
    every node can read."""
    served_model_name: str = "policy"
    work_dir: str = "rlgateway-launch"
    """Checkpoints and published weights (storage every node sees); relative to where the
    launch runs."""
    admin_token: str | None = None
    """The gateways' admin token (default: `RLGATEWAY_ADMIN_TOKEN`, else made up and printed)."""
    gateways: GatewaysSpec = Field(default_factory=lambda: GatewaysSpec())
    engines: EnginesSpec | None = None
    """vLLM or SGLang servers; None: each gateway runs its embedded local engine."""
    trainer: TrainerSpec = Field(default_factory=lambda: TrainerSpec())
    restarts: int = Field(3, ge=0)
    """Restarts of each part (a replica, a server, the trainer) before the launch gives up."""

    def run_config(self) -> TrainConfig:
        """The trainer's config as the spec gives it (before the run's id is known)."""
        return validate_config({**self.trainer.config, **self.decided()}, "trainer.config")

    def decided(self, run_id: str = "") -> dict[str, Any]:
        """The run config's settings the topology decides."""
        out: dict[str, Any] = {"run": run_id, "database_url": self.database_url}
        if self.model != "tiny":  # tiny: each process's own build (the trainer's default)
            out["model"] = self.model
        # absolute: the trainer's processes run in folders of Ray's
        ckpt = self.trainer.config.get("checkpoint_dir")
        out["checkpoint_dir"] = str(Path(ckpt or Path(self.work_dir) / "checkpoints").resolve())
        return out


def load_launch_spec(path: str | Path, overrides: list[str] | None = None) -> LaunchSpec:
    """The spec at `path` with `KEY=VALUE` overrides (`gateways.replicas=3`,
    `trainer.config.max_steps=10`). Raises ValueError naming the file and the field."""
    data = apply_overrides(read_yaml_mapping(path, "launch spec"), overrides or [])
    return parse_launch_spec(data, str(path))


def parse_launch_spec(data: dict[str, Any], source: str = "spec") -> LaunchSpec:
    try:
        spec = LaunchSpec.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{source}: {describe_error(exc, LaunchSpec)}") from None
    for key in ("run", "database_url"):
        if key in spec.trainer.config:
            raise ValueError(f"{source}: trainer.config.{key}: the launch sets it; leave it out")
    spec.run_config()  # the run config is checked whole now, not when the trainer starts
    return spec
