"""The run config: YAML (or a dict from `POST /runs`) validated into `TrainConfig`.

    rlgateway train --config run.yaml algorithm=dapo optim.lr=1e-5 eta=2

Dotted `key=value` overrides are parsed as YAML scalars and applied before validation. Validating
imports no torch (`tests/unit/rlgateway/test_configs.py`), so a bad config fails instantly with a
message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from store.run_config import RunConfig
from trainer.backends.config import (
    BackendConfig,
    BackendSpec,
    FSDPSpec,
    OptimizerSettings,
    as_section,
    runtime_config,
    spec_input,
)
from trainer.parallel.strategy import Allocation


class CriticConfig(BaseModel):
    """The PPO critic (used when the algorithm has `use_critic`, e.g. the ppo preset): the policy's
    architecture and initial weights with a scalar value head, trained by the same backend."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float | None = Field(None, gt=0)
    """The critic's peak AdamW learning rate; None: `optim.lr`. Every other optimizer, schedule
    and precision setting is the policy's."""


class WandbConfig(BaseModel):
    """Weights & Biases logging of the per-step metrics (needs `pip install wandb`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    project: str = "rlgateway"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None: your default."""
    name: str | None = None
    """Run name; None: the training run's id."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online, offline (writes under checkpoint_dir/wandb for a later `wandb sync`), disabled."""


class PublishConfig(BaseModel):
    """How new weights reach the gateway's engines (docs/architecture.md, "Weights")."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["disk", "collective"] = "disk"
    """`disk`: a separate trainer writes each version as a HF directory under
    checkpoint_dir/published and the gateway loads it (the gateway, and its vLLM/SGLang servers,
    must see that filesystem); in `serve --train` the state dict goes to the engine, which
    writes it for remote servers itself. `collective`: the weights are broadcast over a process
    group the servers join (`trainer.collective`; SGLang servers or the in-process router over
    them; no shared filesystem), a version that fails that way going from disk."""
    master_address: str = "127.0.0.1"
    """collective: the trainer's address as the servers reach it."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """collective: the torch.distributed backend of the group; auto: nccl with CUDA, else gloo."""
    bucket_mb: float = Field(512.0, gt=0)
    """The weights go to the engines in buckets of at most this many MiB (a larger tensor alone),
    each gathered from the trainer's shards as it goes: never the whole model on one rank.
    disk: one safetensors file per bucket; collective: the servers receive and load each bucket
    (the in-process engine's swap takes all of them at once)."""
    timeout_s: float = Field(300.0, gt=0)
    """collective: bounds forming the group and each broadcast."""
    keep: int = Field(2, ge=1)
    """disk: published versions kept under checkpoint_dir/published."""

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes."""
        return int(self.bucket_mb * (1 << 20))


_BACKEND: TypeAdapter[Any] = TypeAdapter(BackendSpec)


class ProcessSettings(BaseModel):
    """How one trainer process runs: where it finds its run and store, its identity, how often it
    checkpoints and polls, its leases, its logging and how it publishes. The run's config never
    binds them (`rlgateway.run_merge`): a value stored with the run is a default a trainer's own
    replaces, so a restarted trainer may change any of them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    run: str = ""
    """The run to train (its id from `POST /runs`); trajectories are claimed from it."""
    database_url: str = "sqlite:///rlgateway.db"
    """The trajectory store the gateway records into."""
    trainer_id: str | None = None
    """The trainer's identity as it leases sessions; None: `trainer:<run>`. A restarted trainer
    with the same identity takes back its own leases at once."""
    checkpoint_every: int = Field(1, ge=1)
    """Write a checkpoint every this many steps (and at the last). Steps after the newest
    checkpoint are redone after a crash: their trajectories go back to the queue on resume."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    lease_seconds: float = Field(600.0, gt=0)
    """How long claimed trajectories stay leased before returning to the queue."""
    poll_seconds: float = Field(0.2, gt=0)
    """How often to look for trainable trajectories while waiting."""
    tensorboard: bool = True
    """Write TensorBoard event files under checkpoint_dir/tb."""
    wandb: WandbConfig | None = None
    """Weights & Biases logging of every step's metrics (besides stdout, metrics.jsonl and
    TensorBoard): a `wandb:` section (even `wandb: {}`) turns it on; None: off."""
    publish: PublishConfig = Field(default_factory=lambda: PublishConfig())
    """How new weights reach the engines."""


PROCESS_OWNED = frozenset(ProcessSettings.model_fields)
"""The process-owned settings (`ProcessSettings`); every other setting of a `TrainConfig` is the
run's."""


class TrainConfig(RunConfig, ProcessSettings):
    """Everything a training run needs. Every field has a vetted default except `run`. The
    settings are the run's (those the gateway reads too, `store.run_config.RunConfig`: batch_size,
    eta, max_concurrent, discount, temperature, client_sampling, max_tokens, ...; and the
    training's: model, backend, algorithm, optim, ...), which `rlgateway train` checks against
    the run's stored config, or the process's (`ProcessSettings`), which it does not."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """The initial policy (a HF model directory); None means the tiny model."""
    backend: BackendSpec = Field(default_factory=lambda: FSDPSpec())
    """The training backend, its parallel strategy and its own settings
    (`trainer.backends.config`): a section (`{allocation: archon:e2, aux_loss_coef: 0.01}`,
    `{type: fsdp, attention: sdpa}`) or its allocation alone, `BACKEND[:DIMS]`
    (`trainer.parallel.strategy`): `fsdp`, the default, is FSDP2 data parallel over every rank
    (one process, or as many as torchrun starts); `fsdp:d4` asks for exactly 4; `fsdp:t2` splits
    each layer over 2 tensor ranks, data parallel over the rest (`fsdp:d2t2`: 4 ranks); `fsdp:c2`
    splits each packed row's tokens over 2 context ranks (Ulysses, with the varlen attention;
    `fsdp:d2c2`, `fsdp:c2t2`: 4 ranks); `archon` trains MoE models, `archon:e2` with their
    experts split over groups of 2 data ranks (expert parallel); `megatron` trains on
    megatron-core (`pip install -e '.[megatron]'`, CUDA GPUs), tensor and pipeline parallel:
    `megatron:t2p2` on 4 ranks, `megatron:d1t2p2` exactly so. The fsdp and archon backends take
    `attention` (the kernel inside packed rows), fsdp `prefix_sharing` (a group's common prompt
    once per packed row, `trainer.prefix`), archon `aux_loss_coef` (the router's balance
    loss)."""
    algorithm: str = "grpo"
    """A preset: ppo, grpo, dapo, rloo, gspo, dr_grpo, reinforce_pp."""
    algo: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the preset's knobs (see trainer.algorithms.AlgorithmConfig)."""
    optim: OptimizerSettings = Field(default_factory=lambda: OptimizerSettings())
    """Optimizer, schedule, precision."""
    group_size: int = Field(4, ge=1)
    """Sessions per group (sessions created with one group_id), whose rewards a group baseline
    (grpo, dapo, rloo, gspo, dr_grpo) compares: at least 2 there. 1 only for an algorithm without
    one (ppo, reinforce_pp), whose sessions need no group_id."""
    partial_groups: Literal["wait", "drop", "use"] = "wait"
    """A group with fewer than group_size trainable sessions (members its agents ended as
    failed count toward group_size, never trained): `wait` for the rest until its deadline
    (`group_deadline_seconds`), then train what arrived; `drop` it at its deadline (its
    sessions' outcome `incomplete`); `use` what arrived at once."""
    group_deadline_seconds: float = Field(900.0, gt=0)
    """A group's deadline: this long after its first member ended, an incomplete group is
    judged by `partial_groups` (trained as is, or dropped), so a crashed agent never stalls
    training."""
    session_idle_seconds: float = Field(1800.0, gt=0)
    """A session that was never ended and saw no turn (nor reward) for this long is ended by
    the trainer: trained like any other if it holds a reward, else settled as `orphaned`."""
    stale_tokens: Literal["mask", "drop"] = "mask"
    """Tokens older than `eta` policy versions: `mask` leaves them out of the loss (context only,
    counted in `stale_tokens`), the trajectory trains on the rest (AReaL's token masking);
    `drop` settles any trajectory holding one as `stale`."""
    max_steps: int = Field(100, ge=1)
    """Training steps (policy versions) to run."""
    token_budget: int = Field(1024, ge=16)
    """Tokens per packed micro-batch (gradient accumulation over micro-batches). With the default
    varlen attention (`backend.attention`) attention costs per sequence, not per row, so the budget
    mostly bounds activation memory; on CPU 512-1024 measured fastest (BENCHMARKS.md, Trainer:
    per-sequence attention). With sdpa's block-diagonal mask attention is quadratic in the row:
    keep it near the typical sequence length there. On GPUs raise it (e.g. 16384)."""
    checkpoint_dir: str = "checkpoints"
    """Where checkpoints go (one directory per step; resume picks the newest)."""
    critic: CriticConfig = Field(default_factory=lambda: CriticConfig())
    """The value model of algorithms with a critic (ppo)."""

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        """The spellings of configs stored before the backend's own settings moved into its
        section: `optim.attention` and `moe.aux_loss_coef` are read as `backend.attention` and
        `backend.aux_loss_coef`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        optim, moe = data.get("optim"), data.pop("moe", None)
        legacy: dict[str, Any] = dict(moe) if isinstance(moe, dict) else {}
        if isinstance(optim, dict) and "attention" in optim:
            data["optim"] = {k: v for k, v in optim.items() if k != "attention"}
            legacy["attention"] = optim["attention"]
        if moe is not None and not isinstance(moe, dict):
            legacy["moe"] = moe  # rejected by name
        if legacy:
            backend = as_section(data.get("backend", "fsdp"))
            data["backend"] = {**legacy, **backend} if isinstance(backend, dict) else backend
        return data

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_shorthand(cls, value: Any) -> Any:
        return spec_input(value)

    _algorithm: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        self._resolve()  # a bad preset or knob fails at load time
        algo = self.algorithm_config()
        self.backend.check_run(self.optim, use_critic=algo.use_critic, algorithm=self.algorithm)
        if algo.group_baseline != "none" and self.group_size < 2:
            raise ValueError(
                f"algorithm {self.algorithm!r} baselines each reward against its group's "
                f"(group_baseline {algo.group_baseline}), so with group_size 1 every advantage "
                "is 0 and nothing is learned: set group_size >= 2 and create each group's "
                "sessions with one group_id, or use an algorithm without a group baseline "
                "(ppo, reinforce_pp)"
            )
        buffer = algo.overlong_buffer
        if buffer is not None and self.max_tokens is None:
            raise ValueError(
                f"algo.overlong_buffer ({buffer}) shapes rewards by the run's max_tokens, which "
                "is not set: set max_tokens (the max new tokens per turn, which the gateway "
                "enforces), or algo.overlong_buffer=null to turn overlong shaping off"
            )
        if buffer is not None and self.max_tokens is not None and buffer > self.max_tokens:
            raise ValueError(
                f"algo.overlong_buffer ({buffer}) exceeds max_tokens ({self.max_tokens}): DAPO's "
                "overlong penalty grows over the last overlong_buffer tokens before max_tokens; "
                "set algo.overlong_buffer to at most max_tokens"
            )
        if self.batch_size % self.group_size and self.partial_groups == "wait":
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size "
                f"({self.group_size}) when partial_groups is wait"
            )
        return self

    def _resolve(self) -> None:
        """`algorithm` with `algo`'s overrides (and the run's max_tokens as Dr.GRPO's default
        norm_len) as one `AlgorithmConfig`: once, when the config is validated (and again by
        `model_copy`), not at each use."""
        from trainer.algorithms.config import AlgorithmConfig, algorithm_config

        overrides = dict(self.algo)
        if self.max_tokens is not None:
            overrides.setdefault("norm_len", self.max_tokens)
        try:
            self._algorithm = algorithm_config(self.algorithm, **overrides)
        except ValidationError as exc:
            # raised as a ValueError, so that pydantic reports it under `algo`, with the knob
            raise ValueError(describe_error(exc, AlgorithmConfig, prefix="algo.")) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy, its resolved algorithm that of its own fields."""
        if update and "backend" in update:  # a shorthand becomes its spec, as on validation
            update = {**update, "backend": _BACKEND.validate_python(spec_input(update["backend"]))}
        copy = super().model_copy(update=update, deep=deep)
        copy._resolve()
        return copy

    def algorithm_config(self) -> Any:
        """The algorithm's settings (`trainer.algorithms.AlgorithmConfig`), resolved once."""
        return self._algorithm

    @property
    def allocation(self) -> Allocation:
        """The backend's allocation: the backend and its parallel strategy."""
        return self.backend.allocation

    def backend_config(self, model_dir: str) -> BackendConfig:
        """The policy backend's constructor settings: its spec (`backend`) with `optim`."""
        steps = max(self.max_steps, self.optim.warmup_steps, 1)
        return runtime_config(self.backend, self.optim, model_dir=model_dir, total_steps=steps)

    def critic_backend_config(self, model_dir: str) -> BackendConfig:
        """The critic's backend settings: the policy's, with the critic's learning rate."""
        base = self.backend_config(model_dir)
        if self.critic.lr is None:
            return base
        return base.model_copy(update={"lr": self.critic.lr})


def describe_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """The first error of `exc` as a user fixes it: the dotted key, then what is wrong and, for an
    unknown key, the keys that are allowed there."""
    first = exc.errors()[0]
    loc = [str(x) for x in first["loc"]]
    if first["type"] == "extra_forbidden":
        path, known = _walk(model, loc[:-1])
        where = prefix + ".".join([*path, loc[-1]])
        return f"{where}: unknown key (known here: {', '.join(known)})"
    path, _ = _walk(model, loc)
    where = prefix + ".".join(path) if path else prefix.rstrip(".")
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "value_error" or "input" not in first:
        return f"{where}: {message}" if where else message
    return f"{where}: {message} (got {first['input']!r})"


def _walk(model: type[BaseModel], loc: list[str]) -> tuple[list[str], list[str]]:
    """`loc` as the user wrote it (less the tags pydantic adds for a discriminated union, such as
    `backend.archon`), and the field names of the (nested) model its last key sits in."""
    path: list[str] = []
    candidates: list[type[BaseModel]] = [model]
    for i, part in enumerate(loc):
        tagged = [m for m in candidates if _tag(m) == part]
        if tagged and len(candidates) > 1:
            candidates = tagged  # the union member that pydantic named: not a key of the config
            continue
        path.append(part)
        field = candidates[0].model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [a for a in (annotation, *getattr(annotation, "__args__", ())) if _is_model(a)]
        if not candidates:
            return path + loc[i + 1 :], []
    return path, list(candidates[0].model_fields)


def _tag(model: type[BaseModel]) -> object:
    field = model.model_fields.get("type")
    return field.default if field is not None else None


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def validate_config(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """`data` as a TrainConfig; raises ValueError `SOURCE: KEY: what is wrong`."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{source}: {describe_error(exc, TrainConfig)}") from None


def check_run_config(config: dict[str, Any]) -> None:
    """A run's stored config (`POST /runs`) is a training config minus `run` and the store.
    Raises ValueError naming the field: `config.optim.lr: ...`."""
    try:
        TrainConfig.model_validate({**config, "run": "", "database_url": "sqlite:///x"})
    except ValidationError as exc:
        raise ValueError(describe_error(exc, TrainConfig, prefix="config.")) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` pairs onto a nested dict; values are parsed as YAML scalars. The backend's
    shorthand combines with its keys, in either order: `backend=archon:e2
    backend.aux_loss_coef=0.01` is `backend: {allocation: archon:e2, aux_loss_coef: 0.01}`."""
    out = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. optim.lr=1e-5)")
        node = out
        parts = key.split(".")
        value = yaml.safe_load(raw)
        if parts == ["backend"] and isinstance(out.get("backend"), dict):
            parts = ["backend", "allocation"]  # the shorthand into the section
            out["backend"] = {k: v for k, v in out["backend"].items() if k != "type"}
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if depth == 0 and part == "backend":
                child = as_section(child)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """The YAML file at `path`, which must hold a mapping (an empty file is an empty one).
    Raises ValueError naming `what` and the file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {p} does not exist")
    loaded = yaml.safe_load(p.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{p} must hold a mapping of settings, not {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML run config (or none: defaults) and apply overrides. Raises ValueError with a
    message that names the bad field and file."""
    data = read_yaml_mapping(path, "config file") if path is not None else {}
    return validate_config(apply_overrides(data, overrides or []), str(path or "config"))
