"""A training backend's parallel strategy and its allocation string (`fsdp:d2t2`). No torch.

A strategy has five sizes, after AReaL's `ParallelStrategy` and torchtitan's `ParallelDims`:

- data (`d`): model replicas the batch is split over; FSDP shards the parameters, gradients and
  optimizer state over data x context;
- tensor (`t`): each layer's matrices split across ranks, and so its attention heads;
- context (`c`): each sequence's tokens split across ranks (Ulysses: attention trades tokens for
  heads in an all-to-all, so the heads of a tensor rank split across the context group);
- pipeline (`p`): the layers split into stages;
- expert (`e`): the experts of a mixture-of-experts layer split across ranks.

The world is data x tensor x context x pipeline ranks. Expert parallelism adds no ranks: it is
folded inside data x context (AReaL's MoE parallel folding, torchtitan's `dp_shard_in_ep`), the
expert layers regrouping the ranks that the dense layers use for data and context, so `expert`
must divide data x context.

An allocation names the backend too, in AReaL's per-engine form `BACKEND[:DIMS]`: a backend
(fsdp, archon, megatron) and, after a colon, sizes written as a letter and a positive integer
(`d2t2`; any order, each letter at most once). A size the string leaves out is 1, except data:
without `d` the data size is whatever the world leaves over the others (torchtitan's
`dp_shard = -1`), fixed when the backend knows its world size (`Allocation.for_world`). So a bare
`fsdp` is data parallel over every rank, in one process or many under torchrun; `fsdp:t2` on 8
ranks is `d4t2`; `fsdp:d2` asks for exactly 2 ranks. Which backends and sizes the trainer
implements is `trainer.backends.config`'s business, not the grammar's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

BackendName = Literal["fsdp", "archon", "megatron"]
BACKEND_NAMES: tuple[BackendName, ...] = ("fsdp", "archon", "megatron")
"""The backends an allocation may name (AReaL's training engines)."""

DIMENSIONS: dict[str, str] = {
    "d": "data",
    "t": "tensor",
    "c": "context",
    "p": "pipeline",
    "e": "expert",
}
"""Allocation letter -> `ParallelStrategy` field, in the order an allocation is written."""

_TOKEN = re.compile(r"([A-Za-z])([^A-Za-z]*)")
"""One dimension of DIMS: a letter, then everything up to the next letter (its size)."""
_SIZE = re.compile(r"[0-9]+")


class ParallelStrategy(BaseModel):
    """The sizes of the five parallel dimensions (module docstring). The world is
    data x tensor x context x pipeline ranks; `expert` multiplies nothing, being folded inside
    data x context, which it must divide (`validate_world` checks both once the world is known).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    data: int = Field(1, ge=1)
    """Data-parallel size: model replicas, each training its share of the batch."""
    tensor: int = Field(1, ge=1)
    """Tensor-parallel size: ranks that split each layer's matrices."""
    context: int = Field(1, ge=1)
    """Context-parallel (Ulysses) size: ranks that split each sequence's tokens."""
    pipeline: int = Field(1, ge=1)
    """Pipeline-parallel size: stages the layers are split into."""
    expert: int = Field(1, ge=1)
    """Expert-parallel size: ranks that split the experts, inside data x context."""

    @property
    def world_size(self) -> int:
        """Ranks the strategy spans: data x tensor x context x pipeline (expert is folded in)."""
        return self.data * self.tensor * self.context * self.pipeline

    def sizes(self) -> dict[str, int]:
        """Allocation letter -> size, in `DIMENSIONS` order."""
        return {
            "d": self.data,
            "t": self.tensor,
            "c": self.context,
            "p": self.pipeline,
            "e": self.expert,
        }

    def __str__(self) -> str:
        """The DIMS form of the sizes above 1 (`d2t2`); `d1` when every size is 1."""
        return "".join(f"{k}{n}" for k, n in self.sizes().items() if n > 1) or "d1"


class Allocation(BaseModel):
    """A backend and the strategy it trains with: `BACKEND[:DIMS]` parsed (`parse_allocation`).
    `str()` writes it back in canonical form (letters in `DIMENSIONS` order, sizes of 1 left
    out), which parses to an equal allocation; a string validates into one, so a config field of
    this type takes either."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: BackendName
    """The training backend."""
    strategy: ParallelStrategy = Field(default_factory=lambda: ParallelStrategy())
    """The sizes the string gives, 1 for those it leaves out (`data` is 1 when `data_fills`)."""
    data_fills: bool = True
    """The string gives no `d`: the data size is the world's ranks over the other sizes."""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        return _allocation_fields(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _data_placeholder(self) -> Allocation:
        if self.data_fills and self.strategy.data != 1:
            raise ValueError(
                f"data is {self.strategy.data} but data_fills says the world sets it: "
                "give one or the other"
            )
        return self

    def __str__(self) -> str:
        dims = "".join(
            f"{k}{n}"
            for k, n in self.strategy.sizes().items()
            if n > 1 or (k == "d" and not self.data_fills)
        )
        return f"{self.backend}:{dims}" if dims else self.backend

    def for_world(self, world_size: int) -> ParallelStrategy:
        """The strategy on `world_size` ranks: the data size filled in where the allocation gives
        none, then checked (`validate_world`). ValueError saying what does not fit."""
        strategy = self.strategy
        if self.data_fills:
            others = strategy.world_size  # data is 1 here
            if world_size % others:
                raise ValueError(
                    f"{self}: {world_size} ranks do not split into data x {others} "
                    f"(tensor x context x pipeline of {strategy}): start a multiple of {others} "
                    "processes"
                )
            strategy = strategy.model_copy(update={"data": world_size // others})
        validate_world(strategy, world_size)
        return strategy


def parse_allocation(text: str) -> Allocation:
    """`BACKEND[:DIMS]` (module docstring) as an `Allocation`; ValueError naming the rule that
    `text` breaks."""
    return Allocation(**_allocation_fields(text))


def _allocation_fields(text: str) -> dict[str, Any]:
    """The fields of the `Allocation` that `text` writes (see `parse_allocation`)."""
    name, colon, dims = text.partition(":")
    if not name:
        raise ValueError(
            f"allocation {text!r} names no backend: write BACKEND[:DIMS], e.g. 'fsdp' or 'fsdp:d2'"
        )
    if ":" in dims:
        raise ValueError(
            f"allocation {text!r} has more than one ':': write BACKEND[:DIMS], e.g. 'fsdp:d2t2'"
        )
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown backend {name!r} in {text!r} (known: {', '.join(sorted(BACKEND_NAMES))})"
        )
    if colon and not dims:
        raise ValueError(
            f"allocation {text!r} has no sizes after ':': give some (e.g. 'fsdp:d2') or drop "
            "the ':'"
        )
    sizes = _parse_dims(dims, text)
    strategy = ParallelStrategy(**{DIMENSIONS[k]: n for k, n in sizes.items()})
    if "d" in sizes:
        _check_expert(strategy)
    return {"backend": name, "strategy": strategy, "data_fills": "d" not in sizes}


def _parse_dims(dims: str, text: str) -> dict[str, int]:
    """The sizes of DIMS (`d2t2` -> {"d": 2, "t": 2}) of allocation `text`."""
    if dims and not dims[0].isalpha():
        raise ValueError(
            f"the sizes of {text!r} must start with a dimension letter, not {dims[0]!r}: a "
            "letter, then its size (e.g. 'd2t2')"
        )
    known = ", ".join(f"{k} {name}" for k, name in DIMENSIONS.items())
    sizes: dict[str, int] = {}
    for match in _TOKEN.finditer(dims):
        letter, size = match.groups()
        if letter not in DIMENSIONS:
            raise ValueError(f"unknown dimension {letter!r} in {text!r} (known: {known})")
        if letter in sizes:
            raise ValueError(f"dimension {letter!r} appears twice in {text!r}: give each size once")
        if not size:
            raise ValueError(
                f"dimension {letter!r} in {text!r} has no size: write it as {letter}2, say"
            )
        if not _SIZE.fullmatch(size):
            raise ValueError(
                f"the size of {letter!r} in {text!r} is {size!r}, not a positive integer"
            )
        if int(size) == 0:
            raise ValueError(f"the size of {letter!r} in {text!r} is 0: every size is at least 1")
        sizes[letter] = int(size)
    return sizes


def _check_expert(strategy: ParallelStrategy) -> None:
    folded = strategy.data * strategy.context
    if folded % strategy.expert:
        raise ValueError(
            f"expert size {strategy.expert} must divide data x context = {folded} ({strategy}): "
            "the expert layers regroup the data and context ranks, adding none"
        )


def validate_world(strategy: ParallelStrategy, world_size: int) -> None:
    """ValueError unless `strategy` spans exactly `world_size` ranks and its expert size divides
    data x context."""
    if strategy.world_size != world_size:
        raise ValueError(
            f"strategy {strategy} spans {strategy.world_size} ranks (data x tensor x context x "
            f"pipeline), but the world has {world_size}: start {strategy.world_size} processes "
            "(torchrun --nproc-per-node) or change the sizes"
        )
    _check_expert(strategy)


def validate_for_model(
    strategy: ParallelStrategy,
    *,
    num_attention_heads: int,
    num_key_value_heads: int,
    num_experts: int | None = None,
) -> None:
    """ValueError unless the model's shape splits as `strategy` splits it: tensor parallelism
    splits the attention and key-value heads; Ulysses splits each tensor rank's heads across the
    context group (and its key-value heads, repeating them where there are fewer than the group);
    expert parallelism splits the experts (`num_experts`: None for a dense model)."""
    t, c, e = strategy.tensor, strategy.context, strategy.expert
    heads, kv_heads = num_attention_heads, num_key_value_heads
    if heads % t:
        raise ValueError(
            f"tensor parallel t{t} splits the attention heads, but {heads} heads do not divide "
            f"by {t}"
        )
    if kv_heads % t:
        raise ValueError(
            f"tensor parallel t{t} splits the key-value heads, but {kv_heads} key-value heads do "
            f"not divide by {t}"
        )
    if heads % (t * c):
        raise ValueError(
            f"context parallel c{c} (Ulysses) splits each tensor rank's heads across the context "
            f"group, but {heads} heads do not divide by tensor x context = {t * c}"
        )
    local_kv = kv_heads // t
    if local_kv % c and c % local_kv:
        raise ValueError(
            f"context parallel c{c} (Ulysses) splits each tensor rank's {local_kv} key-value "
            f"heads across the context group: {local_kv} must divide by {c}, or {c} by {local_kv}"
        )
    if num_experts is None and e > 1:
        raise ValueError(
            f"expert parallel e{e} needs a mixture-of-experts model; this one is dense"
        )
    if num_experts is not None and num_experts % e:
        raise ValueError(
            f"expert parallel e{e} splits the experts, but {num_experts} experts do not divide "
            f"by {e}"
        )
