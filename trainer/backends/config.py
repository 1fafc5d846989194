"""Typed settings of the training backends (pydantic; imports no torch, so configs load fast).

A backend config is a union discriminated on `type`; today there is one variant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FSDPBackendConfig(BaseModel):
    """Settings of `trainer.backends.fsdp.FSDPBackend`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["fsdp"] = "fsdp"
    """Backend kind."""
    model_dir: str
    """Hugging Face model directory of the initial policy."""
    lr: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    total_steps: int = Field(1, ge=1)
    """Steps over which `linear`/`cosine` decay the LR to 0."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 parameters and compute with fp32 master weights and gradient reduction."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    seed: int = 0
    """Seed of torch's global RNG in every rank."""
    attention: Literal["varlen", "sdpa", "eager", "flash_attention_2"] = "varlen"
    """Attention kernel of packed rows: varlen (per-sequence SDPA, `trainer.attention`), sdpa or
    eager (one block-diagonal mask over the whole row), or flash_attention_2 (GPU, if installed)."""

    @model_validator(mode="after")
    def _warmup_fits(self) -> FSDPBackendConfig:
        if self.schedule != "constant" and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps}): "
                "raise total_steps or shorten the warmup"
            )
        return self


BackendConfig = FSDPBackendConfig
"""Every backend's config; becomes `Annotated[A | B, Field(discriminator="type")]` with Megatron."""
