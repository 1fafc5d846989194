"""Hugging Face <-> megatron-core weights of a dense decoder (Qwen2, Qwen3, Llama). Pure functions.

megatron-core's GPT (the local, non-Transformer-Engine layer spec) names and lays out a decoder's
weights differently from Hugging Face's, and splits them over tensor-parallel ranks:

| Megatron (per tensor rank)                      | Hugging Face                         | split   |
|-------------------------------------------------|--------------------------------------|---------|
| embedding.word_embeddings.weight                | model.embed_tokens.weight            | rows    |
| output_layer.weight                             | lm_head.weight                       | rows    |
| decoder.final_layernorm.weight                  | model.norm.weight                    | -       |
| L.input_layernorm.weight                        | l.input_layernorm.weight             | -       |
| L.self_attention.linear_qkv.{weight,bias}       | l.self_attn.{q,k,v}_proj.{w,b}       | groups  |
| L.self_attention.{q,k}_layernorm.weight         | l.self_attn.{q,k}_norm.weight        | -       |
| L.self_attention.linear_proj.weight             | l.self_attn.o_proj.weight            | columns |
| L.pre_mlp_layernorm.weight                      | l.post_attention_layernorm.weight    | -       |
| L.mlp.linear_fc1.weight                         | l.mlp.{gate,up}_proj.weight          | fused   |
| L.mlp.linear_fc2.weight                         | l.mlp.down_proj.weight               | columns |

- Fused QKV: the rows are grouped by key-value head: for each of the G groups, its H/G query heads,
  then its key head, then its value head (d rows each). A tensor rank holds G/t whole groups, so
  the full tensor is the ranks' rows concatenated.
- Fused gate/up: a tensor rank holds its slice of the gate rows, then its slice of the up rows, so
  the full tensor is [gate_0; up_0; gate_1; up_1; ...], which depends on t.
- The vocabulary is padded to a multiple of t (Megatron's vocab-parallel layers split it evenly):
  rank r holds rows [r * Vp / t, (r + 1) * Vp / t) of the padded embedding and output layer, the
  padding rows zero. Logprobs drop the padding columns before the softmax (`vocab_range`), so they
  are the unpadded model's.
- Pipeline stages hold consecutive layers (`stage_layers`), numbered from 0 within the stage
  (Megatron's local layer numbers); the embedding is on the first stage, the final norm and the
  output layer on the last. A model with tied embeddings has no `output_layer.weight`; its
  embedding converts back to both `model.embed_tokens.weight` and `lm_head.weight`, as the
  Hugging Face model's state dict has them.

`to_megatron` gives one (tensor rank, stage)'s local state dict from the Hugging Face one;
`to_hf` turns one full (tensor-gathered) Megatron tensor back into its Hugging Face tensors, so
weights can be published a tensor at a time; `merge_tensor_ranks` is that gather on tensors in
memory. HF -> Megatron -> HF is bit-exact (a round trip only moves rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

Split = Literal["rows", "columns", "replicated"]
"""How a Megatron tensor is split over tensor ranks: along dim 0, along dim 1, or not at all."""

FAMILIES = ("qwen2", "qwen3", "llama")
"""The Hugging Face `model_type`s the converter and the Megatron backend build."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What the conversion needs of a model and of its split: width `hidden`, `heads` query heads
    and `groups` key-value heads of `head_dim` each, `vocab` ids padded to `padded_vocab` (a
    multiple of `tensor`), `tensor` ranks, `pipeline` stages of `layers / pipeline` layers each."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    intermediate: int
    vocab: int
    padded_vocab: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def of(cls, config: Any, tensor: int = 1, pipeline: int = 1) -> Layout:
        """The layout of Hugging Face `config` split `tensor` x `pipeline` ways; ValueError when
        the family is not one of `FAMILIES` or the sizes do not divide."""
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"the megatron backend builds {', '.join(FAMILIES)} models; this one is "
                f"{config.model_type!r}: train it with fsdp"
            )
        heads, groups = config.num_attention_heads, config.num_key_value_heads
        if heads % tensor or groups % tensor:
            raise ValueError(
                f"tensor parallel t{tensor} splits whole heads: {heads} attention heads and "
                f"{groups} key-value heads must divide by {tensor}"
            )
        if config.num_hidden_layers % pipeline:
            raise ValueError(
                f"pipeline parallel p{pipeline} gives every stage the same number of layers: "
                f"{config.num_hidden_layers} layers do not divide by {pipeline}"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        vocab = config.vocab_size
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            groups=groups,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=vocab,
            padded_vocab=-(-vocab // tensor) * tensor,
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=config.model_type == "qwen3",
            tied=bool(config.tie_word_embeddings),
            tensor=tensor,
            pipeline=pipeline,
        )

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.pipeline


def stage_layers(layout: Layout, stage: int) -> range:
    """The global layer numbers that pipeline `stage` holds."""
    n = layout.layers_per_stage
    return range(stage * n, (stage + 1) * n)


def vocab_range(layout: Layout, rank: int) -> tuple[int, int]:
    """[start, end) of the real (unpadded) ids among tensor `rank`'s rows of the padded vocabulary;
    the rank's first `end - start` logit columns are those ids."""
    per = layout.padded_vocab // layout.tensor
    start = min(rank * per, layout.vocab)
    return start, min(start + per, layout.vocab)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

_LAYER_NAMES: dict[str, tuple[tuple[str, ...], Split]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
        "rows",
    ),
    "self_attention.linear_qkv.bias": (tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), "rows"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "columns"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "rows"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "columns"),
}
"""A layer's Megatron tensor (after `decoder.layers.N.`) -> its HF tensors (after
`model.layers.N.`) and its tensor-parallel split."""

_MODEL_NAMES: dict[str, tuple[str, Split]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "rows"),
    "decoder.final_layernorm.weight": ("model.norm.weight", "replicated"),
    "output_layer.weight": ("lm_head.weight", "rows"),
}


def megatron_names(layout: Layout, stage: int) -> Iterator[str]:
    """The Megatron tensors of pipeline `stage`, local layer numbers, in a fixed order."""
    if stage == 0:
        yield "embedding.word_embeddings.weight"
    for local in range(layout.layers_per_stage):
        for suffix in _LAYER_NAMES:
            if suffix.endswith("bias") and not layout.qkv_bias:
                continue
            if "_layernorm" in suffix and "self_attention" in suffix and not layout.qk_norm:
                continue
            yield f"decoder.layers.{local}.{suffix}"
    if stage == layout.pipeline - 1:
        yield "decoder.final_layernorm.weight"
        if not layout.tied:
            yield "output_layer.weight"


def full_shape(layout: Layout, name: str) -> tuple[int, ...]:
    """The shape of Megatron tensor `name` gathered over the tensor ranks (padded vocabulary)."""
    h, d = layout.hidden, layout.head_dim
    qkv = (layout.heads + 2 * layout.groups) * d
    match = _LAYER.fullmatch(name)
    if match is None:
        return (h,) if name == "decoder.final_layernorm.weight" else (layout.padded_vocab, h)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_qkv.bias": (qkv,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, layout.heads * d),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * layout.intermediate, h),
        "mlp.linear_fc2.weight": (h, layout.intermediate),
    }
    return shapes[match[2]]


def split_of(name: str) -> Split:
    """How Megatron tensor `name` is split over tensor ranks."""
    match = _LAYER.fullmatch(name)
    if match:
        return _LAYER_NAMES[match[2]][1]
    return _MODEL_NAMES[name][1]


def hf_names(layout: Layout, name: str, stage: int) -> tuple[str, ...]:
    """The HF tensors that stage `stage`'s Megatron tensor `name` holds."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return (_MODEL_NAMES[name][0],)
    layer = stage * layout.layers_per_stage + int(match[1])
    return tuple(f"model.layers.{layer}.{n}" for n in _LAYER_NAMES[match[2]][0])


def _rank_rows(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[rank * n : (rank + 1) * n]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _grouped_qkv(layout: Layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Q, K, V rows interleaved by key-value group (the module docstring's fused QKV)."""
    g, d = layout.groups, layout.head_dim
    parts = [q.reshape(g, layout.heads // g * d, *q.shape[1:])]
    parts += [x.reshape(g, d, *x.shape[1:]) for x in (k, v)]
    return torch.cat(parts, 1).reshape(-1, *q.shape[1:])


def to_megatron(
    hf: Mapping[str, torch.Tensor], layout: Layout, rank: int = 0, stage: int = 0
) -> dict[str, torch.Tensor]:
    """Tensor rank `rank`'s and pipeline stage `stage`'s Megatron state dict (new tensors) from
    the full HF state dict `hf` (a tied model's `lm_head.weight` may be absent)."""
    t = layout.tensor
    out: dict[str, torch.Tensor] = {}
    for name in megatron_names(layout, stage):
        sources = [hf[n] for n in hf_names(layout, name, stage)]
        split = split_of(name)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = _padded(sources[0], layout.padded_vocab)
        elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            full = _grouped_qkv(layout, *sources)
        elif name.endswith("linear_fc1.weight"):
            gate, up = sources
            out[name] = torch.cat([_rank_rows(gate, rank, t), _rank_rows(up, rank, t)]).clone()
            continue
        else:
            full = sources[0]
        if split == "rows":
            full = _rank_rows(full, rank, t)
        elif split == "columns":
            full = full.chunk(t, 1)[rank]
        out[name] = full.clone()
    return out


def merge_tensor_ranks(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor `name` from its tensor ranks' parts, in rank order (what an
    all-gather over the tensor group gives): rows or columns concatenated."""
    split = split_of(name)
    if split == "replicated":
        return parts[0]
    return torch.cat(parts, 0 if split == "rows" else 1)


def to_hf(layout: Layout, name: str, stage: int, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF tensors of stage `stage`'s Megatron tensor `name`, from its full value `full`
    (`merge_tensor_ranks` of every tensor rank's part); views of `full` where the layout allows."""
    names = hf_names(layout, name, stage)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if layout.tied:  # one tensor, both names (as in the Hugging Face model's state dict)
            return {
                "model.embed_tokens.weight": full[: layout.vocab],
                "lm_head.weight": full[: layout.vocab],
            }
        return {names[0]: full[: layout.vocab]}
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        g, d = layout.groups, layout.head_dim
        per = layout.heads // g * d
        grouped = full.reshape(g, per + 2 * d, *full.shape[1:])
        q, k, v = torch.split(grouped, [per, d, d], 1)
        rest = full.shape[1:]
        return dict(zip(names, (x.reshape(-1, *rest) for x in (q, k, v)), strict=True))
    if name.endswith("linear_fc1.weight"):
        ranks = full.reshape(layout.tensor, 2, -1, *full.shape[1:])
        gate, up = (ranks[:, i].reshape(layout.intermediate, *full.shape[1:]) for i in (0, 1))
        return dict(zip(names, (gate, up), strict=True))
    return {names[0]: full}
