"""A pipeline stage of megatron-core's GPT built from a Hugging Face config, and its forward.

`build_stage` makes the `GPTModel` of one pipeline stage with megatron-core's local layer spec
(its own linear layers, RMSNorm and dot-product attention: no Transformer Engine, so it builds
wherever megatron-core installs) and wraps it in `Stage`, whose forward differs from
`GPTModel.forward` in one place: the rotary embedding. `GPTModel` rotates position p of a row by
p; packed rows (`trainer.batch.MicroBatch`) restart positions at every sequence, so `Stage` builds
the rotary angles from the row's position ids and hands them to the decoder, and attention gets a
block-diagonal causal mask (`packed_mask`) so that no token sees another sequence. The angles use
Hugging Face's own inverse frequencies (`transformers`' rotary-embedding class of the family, so
its rope scaling types carry over), which is what makes the logits those of the Hugging Face
model (tests/integration/trainer/test_megatron.py: 1e-5 in float32, tensor parallel 1 and 2).

The vocabulary is padded to a multiple of the tensor size (`trainer.megatron.convert`); the
stage's logits keep the padding columns, which `trainer.backends.megatron` drops.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.megatron.convert import Layout, split_of

_ROTARY: dict[str, str] = {
    "qwen2": "transformers.models.qwen2.modeling_qwen2:Qwen2RotaryEmbedding",
    "qwen3": "transformers.models.qwen3.modeling_qwen3:Qwen3RotaryEmbedding",
    "llama": "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding",
}
"""Family -> its Hugging Face rotary embedding (the source of the inverse frequencies)."""


def check_config(config: Any) -> None:
    """ValueError unless the decoder of HF `config` is one `build_stage` reproduces exactly."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"the megatron backend builds SwiGLU MLPs; this model has {config.hidden_act}"
        )
    if getattr(config, "mlp_bias", False):
        raise ValueError("the megatron backend builds MLPs without biases; this model has mlp_bias")
    if config.model_type != "qwen2" and getattr(config, "attention_bias", False):
        raise ValueError(
            "the megatron backend gives only the fused QKV projection a bias (Qwen2's); this "
            "model sets attention_bias, which biases the output projection too: train it with fsdp"
        )
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or ()
    ):
        raise ValueError(
            "the megatron backend runs full attention in every layer; this model slides"
        )


def rotary_inverse_frequencies(config: Any) -> torch.Tensor:
    """[head_dim / 2] float32: Hugging Face's rotary inverse frequencies for `config`;
    ValueError where its rope type also scales the attention (which `Stage` does not)."""
    module, _, name = _ROTARY[config.model_type].partition(":")
    rotary = getattr(importlib.import_module(module), name)(config)
    if float(rotary.attention_scaling) != 1.0:
        raise ValueError(
            f"this model's rope ({config.rope_parameters}) scales attention by "
            f"{rotary.attention_scaling}; the megatron backend does not: train it with fsdp"
        )
    inverse: torch.Tensor = rotary.inv_freq
    return inverse.to(torch.float32)


def transformer_config(
    config: Any, layout: Layout, *, recompute: bool, params_dtype: torch.dtype = torch.float32
) -> Any:
    """megatron-core's `TransformerConfig` of HF `config` split as `layout` says (fused kernels
    off: they need Apex or Transformer Engine; losses computed per token, as the loss callback
    normalises them itself)."""
    from megatron.core.transformer import TransformerConfig

    recompute_args: dict[str, Any] = {}
    if recompute:  # every layer's activations recomputed in backward (HF gradient checkpointing)
        recompute_args = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return TransformerConfig(
        num_layers=layout.layers,
        hidden_size=config.hidden_size,
        num_attention_heads=layout.heads,
        num_query_groups=layout.groups,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.intermediate,
        activation_func=F.silu,
        gated_linear_unit=True,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0)),
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # the weights come from the HF checkpoint
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        variable_seq_lengths=True,  # packed rows differ in length
        moe_token_dispatcher_type="alltoall",  # required with variable lengths, unused (dense)
        calculate_per_token_loss=True,
        **recompute_args,
    )


class Stage(nn.Module):
    """One pipeline stage of the GPT: embedding (first stage), its decoder layers, and final norm
    and output layer (last stage). `forward` takes a packed row and returns its hidden states
    [T, 1, H] (to the next stage), or on the last stage the logits [T, 1, Vp / t] of this tensor
    rank's slice of the padded vocabulary."""

    def __init__(self, gpt: nn.Module, inverse_frequencies: torch.Tensor) -> None:
        super().__init__()
        # `module`: megatron-core finds a wrapped model's config and type there
        self.module = gpt
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inverse_frequencies, persistent=False)

    def set_input_tensor(self, tensor: Any) -> None:
        """The previous stage's hidden states (the pipeline schedule sets them)."""
        self.module.set_input_tensor(tensor)  # type: ignore[operator]

    def forward(
        self, input_ids_1T: torch.Tensor, position_ids_1T: torch.Tensor, mask_11TT: torch.Tensor
    ) -> torch.Tensor:
        gpt: Any = self.module
        hidden = (
            gpt.embedding(input_ids=input_ids_1T, position_ids=None) if gpt.pre_process else None
        )
        angles_Td = position_ids_1T[0].to(torch.float32)[:, None] * self.inv_freq[None, :]
        rotary = torch.cat([angles_Td, angles_Td], -1)[:, None, None, :]
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=mask_11TT, rotary_pos_emb=rotary)
        if not gpt.post_process:
            return hidden  # type: ignore[no-any-return]
        weight = (
            gpt.shared_embedding_or_output_weight()
            if gpt.share_embeddings_and_output_weights
            else None
        )
        logits, _ = gpt.output_layer(hidden, weight=weight)
        return logits  # type: ignore[no-any-return]


def packed_mask(position_ids_1T: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is masked: a token attends to itself and the
    earlier tokens of its own sequence (a sequence starts where the position ids restart at 0)."""
    positions = position_ids_1T[0]
    sequence = torch.cumsum(positions == 0, 0)
    t = positions.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    allowed = causal & (sequence[:, None] == sequence[None, :])
    return (~allowed)[None, None]


def build_stage(config: Any, layout: Layout, stage: int, *, recompute: bool) -> Stage:
    """The `Stage` of pipeline `stage` for HF `config` under `layout` (megatron-core's parallel
    state must be initialised with the layout's sizes), weights uninitialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_config(config)
    gpt = GPTModel(
        transformer_config(config, layout, recompute=recompute),
        get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm"),
        vocab_size=layout.padded_vocab,
        max_sequence_length=config.max_position_embeddings,
        pre_process=stage == 0,
        post_process=stage == layout.pipeline - 1,
        share_embeddings_and_output_weights=layout.tied,
        position_embedding_type="none",  # `Stage` rotates by the row's own positions
    )
    # megatron-core marks a parameter as split when it initialises it; these weights come from
    # the checkpoint, so mark them here (grad clipping counts a replicated parameter once)
    for name, param in gpt.named_parameters():
        split = split_of(name)
        if split != "replicated":  # megatron-core's attributes (tensor_parallel.layers)
            param.tensor_model_parallel = True
            param.partition_dim = 0 if split == "rows" else 1
            param.partition_stride = 1
    return Stage(gpt, rotary_inverse_frequencies(config))
