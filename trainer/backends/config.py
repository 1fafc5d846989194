"""Typed settings of the training backends (pydantic; imports no torch, so configs load fast).

A run config's `backend` is a spec, a union discriminated on `type`: `fsdp` (dense models),
`archon` (MoE) and `megatron` (dense models on megatron-core, an optional extra), each with its
allocation and the settings of that backend alone (`attention`, `aux_loss_coef`), each declared
once. A backend is built from its spec with the run's optimizer settings (`OptimizerSettings`), the
model and the schedule's length: `runtime_config`, whose classes are the spec's and the
optimizer's fields together (`FSDPBackendConfig`, ...), the constructor's arguments.
Every backend trains with an `Allocation` (`trainer.parallel.strategy`): `IMPLEMENTED` says which
backends exist and which parallel dimensions each implements, and `check_implemented` refuses the
rest when the config loads, never ignoring a size it cannot honour.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from trainer.parallel.strategy import DIMENSIONS, Allocation, parse_allocation

IMPLEMENTED: dict[str, tuple[str, ...]] = {
    "fsdp": ("data", "tensor", "context"),
    "archon": ("data", "expert"),
    "megatron": ("data", "tensor", "pipeline"),
}
"""Backend -> the `ParallelStrategy` sizes it implements; a backend not here does not exist yet.
FSDP2 is data parallel, tensor parallel (DTensor, `trainer.parallel.tensor`) inside each data
rank, and context parallel (Ulysses, `trainer.parallel.ulysses`, around the varlen attention).
The MoE backend, archon, is FSDP2 data parallel with expert parallelism folded into the data
ranks (`trainer.parallel.expert`). The megatron backend is megatron-core's tensor and pipeline
parallelism with data parallelism around them (`trainer.backends.megatron`)."""

DATA_PARALLEL = Allocation(backend="fsdp")
"""A bare `fsdp`: FSDP2 data parallel over every rank."""


def check_implemented(allocation: Allocation) -> Allocation:
    """`allocation` when its backend exists and implements every size above 1 that it asks for;
    otherwise ValueError naming what is missing."""
    text = str(allocation)
    if allocation.backend not in IMPLEMENTED:
        raise ValueError(
            f"backend {allocation.backend!r} is not implemented yet ({text!r}); the trainer has: "
            + ", ".join(IMPLEMENTED)
        )
    implemented = IMPLEMENTED[allocation.backend]
    for letter, size in allocation.strategy.sizes().items():
        name = DIMENSIONS[letter]
        if size > 1 and name not in implemented:
            raise ValueError(
                f"{allocation.backend}: {name} parallel is not implemented yet "
                f"({letter}{size} in {text!r})"
            )
    return allocation


def check_context_attention(allocation: Allocation, attention: str) -> None:
    """ValueError unless `attention` is the per-sequence kernel where `allocation` is context
    parallel: Ulysses attention wraps that kernel, which finds the row's sequences from the whole
    row's position ids (the other kernels' masks would come from one slice's positions)."""
    context = allocation.strategy.context
    if context > 1 and attention != "varlen":
        raise ValueError(
            f"context parallel c{context} runs Ulysses attention around the varlen kernel, not "
            f"{attention!r}: set attention to varlen"
        )


def check_prefix_sharing(allocation: Allocation, attention: str, prefix_sharing: bool) -> None:
    """ValueError where prefix sharing is asked for but the attention kernel or the context
    split cannot attend a branch to its trunk: only the varlen kernel reads the tree from the
    positions, and a context rank's slice of a row may hold a branch without its trunk."""
    if not prefix_sharing:
        return
    if attention != "varlen":
        raise ValueError(
            f"prefix_sharing needs the varlen attention, which reads the trees from the "
            f"positions; {attention!r} would attend across them: set attention to varlen"
        )
    if allocation.strategy.context > 1:
        raise ValueError(
            f"prefix_sharing is not implemented under context parallelism "
            f"(c{allocation.strategy.context}): a slice of a row may hold a branch but not its "
            "trunk"
        )


class OptimizerSettings(BaseModel):
    """The optimizer, learning-rate schedule and precision settings, declared once: a run
    config's `optim` (`trainer.config.OptimConfig`) and every backend's config inherit them, and
    the backends' constructors take their defaults from `OPTIMIZER_DEFAULTS`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(1e-5, ge=0)
    """Peak AdamW learning rate; 0 trains nothing (a control run: every update is zero)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup (`linear`/`cosine` decay to 0 over the run's steps)."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 parameters and compute with fp32 master weights and gradient reduction
    where the device supports it."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    seed: int = 0
    """Seed of torch's global RNG in every rank."""


OPTIMIZER_DEFAULTS = OptimizerSettings()
"""The defaults of every optimizer setting, where a constructor needs them as values."""


class _BackendSpec(BaseModel):
    """What a run config's `backend` section says (`TrainConfig.backend`): the backend, its
    allocation, and the settings of that backend alone. A string (`fsdp:d2t2`) is the shorthand
    of `{allocation: fsdp:d2t2}`, and `type` may be left out where `allocation` names it."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: str
    """Backend kind (each backend's spec fixes it)."""
    allocation: Allocation = DATA_PARALLEL
    """The backend and its parallel strategy (a string such as `fsdp`, `fsdp:d4`, `fsdp:d2t2`,
    `fsdp:d2c2` or `archon:d4e2` validates into one; it is written back as that string); the
    default is the backend's data parallel over every rank."""

    prefix_sharing_refused: ClassVar[str] = ""
    """Why this backend cannot pack prefix-shared trees (`FSDPSpec.prefix_sharing`); empty where
    it can."""

    @field_serializer("allocation")
    def _allocation_text(self, allocation: Allocation) -> str:
        return str(allocation)

    @model_validator(mode="before")
    @classmethod
    def _refuse_prefix_sharing(cls, data: Any) -> Any:
        if cls.prefix_sharing_refused and isinstance(data, dict) and "prefix_sharing" in data:
            if data["prefix_sharing"]:
                raise ValueError(f"prefix_sharing: {cls.prefix_sharing_refused}")
            data = {k: v for k, v in data.items() if k != "prefix_sharing"}
        return data

    @model_validator(mode="after")
    def _check_allocation(self) -> _BackendSpec:
        if self.allocation.backend != self.type:
            raise ValueError(
                f"the {self.type} backend's allocation names {self.allocation.backend!r}: "
                f"use {self.type}"
            )
        check_implemented(self.allocation)
        return self

    def __str__(self) -> str:
        return str(self.allocation)

    @property
    def packs_trees(self) -> bool:
        """Whether this backend packs prefix-shared trees (`FSDPSpec.prefix_sharing`)."""
        return False

    def check_run(self, optim: OptimizerSettings, *, use_critic: bool, algorithm: str) -> None:
        """ValueError where this backend cannot train under the run's other settings."""


class _HFBackendSpec(_BackendSpec):
    """The backends that train the Hugging Face model itself (fsdp, archon)."""

    attention: Literal["varlen", "sdpa", "eager", "flash_attention_2"] = "varlen"
    """Attention kernel of packed rows: varlen (per-sequence SDPA, `trainer.attention`; it costs
    per sequence, not per row), sdpa or eager (one block-diagonal mask over the whole row), or
    flash_attention_2 (GPU, if installed)."""

    @model_validator(mode="after")
    def _check_attention(self) -> _HFBackendSpec:
        check_context_attention(self.allocation, self.attention)
        return self


class FSDPSpec(_HFBackendSpec):
    """`trainer.backends.fsdp.FSDPBackend`: data, tensor and context parallelism (the last with
    the varlen attention)."""

    type: Literal["fsdp"] = "fsdp"
    """Backend kind."""
    prefix_sharing: bool = False
    """Pack sequences that begin alike (a GRPO group's prompt, an episode's shared history) as
    trees: their common tokens once per row, each answer attending to them (`trainer.prefix`);
    every logprob, entropy and loss term is the flat packing's. Needs the varlen attention and
    one context rank."""

    @model_validator(mode="after")
    def _check_prefix_sharing(self) -> FSDPSpec:
        check_prefix_sharing(self.allocation, self.attention, self.prefix_sharing)
        return self

    @property
    def packs_trees(self) -> bool:
        return self.prefix_sharing


class ArchonSpec(_HFBackendSpec):
    """`trainer.backends.archon.ArchonBackend`, the MoE backend: data and expert parallelism, and
    the router's balance loss."""

    type: Literal["archon"] = "archon"
    """Backend kind."""
    prefix_sharing_refused: ClassVar[str] = (
        "the archon backend cannot pack prefix-shared trees: its router's balance loss counts "
        "each sequence's tokens, the shared ones included; use fsdp"
    )
    allocation: Allocation = Allocation(backend="archon")
    """As for every backend; a bare `archon` is data parallel with every expert on every rank,
    `archon:e2` splits the experts over groups of 2 data ranks."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router's per-sequence balance loss (`trainer.moe`) in the policy's loss; 0,
    the default, leaves routing to the reward and reports the balance loss as a metric."""


class MegatronSpec(_BackendSpec):
    """`trainer.backends.megatron.MegatronBackend`: data, tensor and pipeline parallelism on
    megatron-core (attention is megatron-core's, over a block-diagonal mask). The optimizer's
    `gradient_checkpointing` recomputes every layer (megatron-core's full recompute); training
    is float32 (bf16 is not implemented for it), and it builds no critic."""

    type: Literal["megatron"] = "megatron"
    """Backend kind."""
    prefix_sharing_refused: ClassVar[str] = (
        "the megatron backend cannot pack prefix-shared trees: megatron-core's attention runs "
        "over a block-diagonal mask of whole sequences; use fsdp"
    )
    allocation: Allocation = Allocation(backend="megatron")
    """As for every backend: `megatron:t2` splits each layer over 2 tensor ranks, `megatron:p2`
    the layers over 2 pipeline stages, `megatron:d2t2p2` both, twice over (8 ranks)."""

    def check_run(self, optim: OptimizerSettings, *, use_critic: bool, algorithm: str) -> None:
        if optim.mixed_precision != "fp32":
            raise ValueError(
                "the megatron backend trains in fp32 (its bf16 path is not implemented): "
                "set optim.mixed_precision to fp32, or use fsdp"
            )
        if use_critic:
            raise ValueError(
                f"algorithm {algorithm!r} trains a critic, which the megatron backend does not "
                "build: use fsdp for it, or a critic-free algorithm (grpo, ...)"
            )


BackendSpec = Annotated[FSDPSpec | ArchonSpec | MegatronSpec, Field(discriminator="type")]
"""A run config's `backend`, discriminated on `type` (`spec_input` reads the shorthands)."""

SHORTHAND_KEY = "allocation"
"""The key a string `backend` stands for: `backend: fsdp:d2` is `backend: {allocation: fsdp:d2}`."""


def as_section(value: Any) -> Any:
    """A `backend` as a mapping: a string is the shorthand of its allocation."""
    return {SHORTHAND_KEY: value} if isinstance(value, str) else value


def spec_input(value: Any) -> Any:
    """A `backend` as written (a string, or a mapping that may leave `type` to its allocation) in
    the form the discriminated union validates; ValueError for an allocation that does not parse.
    Anything else is returned as it is, for pydantic to reject."""
    value = as_section(value)
    if isinstance(value, dict) and "type" not in value:
        allocation = value.get("allocation", "fsdp")
        if isinstance(allocation, str):
            allocation = parse_allocation(allocation)
        if isinstance(allocation, Allocation):
            return {"type": allocation.backend, **value}
    return value


class _Runtime(OptimizerSettings):
    """What every backend's constructor takes besides its spec: the optimizer's settings (the
    run's `optim`), the initial policy and the length of the LR schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model_dir: str
    """Hugging Face model directory of the initial policy."""
    total_steps: int = Field(1, ge=1)
    """Steps over which `linear`/`cosine` decay the LR to 0."""

    @model_validator(mode="after")
    def _check_warmup(self) -> _Runtime:
        if self.schedule != "constant" and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps}): "
                "raise total_steps or shorten the warmup"
            )
        return self


class FSDPBackendConfig(FSDPSpec, _Runtime):
    """`FSDPBackend`'s constructor arguments: its spec and the runtime settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ArchonBackendConfig(ArchonSpec, _Runtime):
    """`ArchonBackend`'s constructor arguments: its spec and the runtime settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class MegatronBackendConfig(MegatronSpec, _Runtime):
    """`MegatronBackend`'s constructor arguments: its spec and the runtime settings (float32)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    mixed_precision: Literal["fp32"] = "fp32"
    """float32 weights and compute (megatron-core's bf16 path is not implemented here)."""


BackendConfig = Annotated[
    FSDPBackendConfig | ArchonBackendConfig | MegatronBackendConfig, Field(discriminator="type")
]
"""Every backend's constructor settings, discriminated on `type`."""

RuntimeConfig = FSDPBackendConfig | ArchonBackendConfig | MegatronBackendConfig
"""One backend's constructor settings (`BackendConfig` without the discriminator)."""

RUNTIME_CONFIGS: dict[str, type[RuntimeConfig]] = {
    "fsdp": FSDPBackendConfig,
    "archon": ArchonBackendConfig,
    "megatron": MegatronBackendConfig,
}
"""Each backend's constructor settings by `type`."""


def runtime_config(
    spec: FSDPSpec | ArchonSpec | MegatronSpec,
    optim: OptimizerSettings,
    *,
    model_dir: str,
    total_steps: int,
) -> RuntimeConfig:
    """The settings `spec`'s backend is built from: the spec's, the optimizer's, the model."""
    settings = {
        **optim.model_dump(include=set(OptimizerSettings.model_fields)),
        **dict(spec),
        "model_dir": model_dir,
        "total_steps": total_steps,
    }
    return RUNTIME_CONFIGS[spec.type].model_validate(settings)
