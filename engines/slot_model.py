"""A Llama-family Hugging Face causal LM run with a slot-based KV cache.

The local engine owns attention and the KV cache (as every serving engine does) and borrows
everything else from the transformers model: embeddings, projections, norms, rotary embedding, MLP
and LM head, so weights stay in the HF module tree and a weight update is a `copy_` into it.

Each live sequence owns one slot `s` of per-layer buffers `k[s, :, :len_s]`, `v[s, :, :len_s]`.
Live sequences occupy slots 0..B-1 (the engine keeps them compact), so a decode step over B
sequences reads the buffers' first B rows without gathering.

Shapes: B = batch of sequences, T = new tokens, L = cached length, H = query heads,
K = key/value heads, D = head dim, E = hidden size, V = vocabulary.

Supported: model types whose decoder layer is `input_layernorm -> self_attn(q/k/v/o_proj,
optional q_norm/k_norm) -> post_attention_layernorm -> mlp` with full (not sliding) attention:
qwen2, qwen3, llama, mistral, and qwen3_moe, whose `mlp` is the HF sparse block (router, then
the chosen experts; a tensor in, a tensor out since transformers 5.0), which routes each token on
its own, so batching does not change routing. The parity tests hold this forward against the
model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engines.packed_linear import FusedLinear, gated_mlp, packing_available

KVWriter = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Writes one layer's new keys/values [B, K, T, D] to the cache; returns all cached [B, K, L, D]."""

SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral", "qwen3_moe"})


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BHTD * cos + _rotate_half(x_BHTD) * sin


class SlotModel:
    """Prefill and batched decode of a HF causal LM over slot-owned KV buffers."""

    def __init__(
        self,
        model: Any,
        *,
        max_slots: int,
        max_model_len: int,
        packed: bool | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`packed`: run the projections on prepacked weights (`engines.packed_linear`; None:
        wherever oneDNN runs them). `cache_dtype`: the attention's and the KV cache's (None:
        float32 on a CPU, the model's dtype elsewhere)."""
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the local engine runs {sorted(SUPPORTED_MODEL_TYPES)} models, not "
                f"{cfg.model_type!r}: serve this model with --engine vllm or --engine sglang"
            )
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("the local engine does not implement sliding-window attention")
        self.model = model
        self.inner = model.model
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // (
            cfg.num_attention_heads
        )
        self.vocab_size: int = cfg.vocab_size
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Attention and the KV cache run in float32 on a CPU whatever the weights' dtype: torch's
        # CPU attention is several times slower in bfloat16 than in float32 (BENCHMARKS.md), and
        # float32 is the more exact. On CUDA they stay in the model's dtype.
        if cache_dtype is None:
            cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.cache_dtype = cache_dtype
        self.packed = packing_available(self.device, self.dtype) if packed is None else packed
        self._qkv: list[FusedLinear] = []
        self._o: list[FusedLinear] = []
        self._mlp: list[tuple[FusedLinear, FusedLinear, Any] | None] = []
        for layer in self.inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._qkv.append(self._fused(attn.q_proj, attn.k_proj, attn.v_proj))
            self._o.append(self._fused(attn.o_proj))
            dense = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            self._mlp.append(
                (self._fused(mlp.gate_proj, mlp.up_proj), self._fused(mlp.down_proj), mlp.act_fn)
                if dense
                else None  # a sparse MoE block runs as the model's own module
            )
        self._lm_head = self._fused(model.lm_head)
        self._all_fused = [*self._qkv, *self._o, self._lm_head]
        self._all_fused += [f for mlp in self._mlp if mlp is not None for f in mlp[:2]]
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._ensure_capacity(min(256, max_model_len))

    def _fused(self, *modules: Any) -> FusedLinear:
        return FusedLinear(modules, packed=self.packed, batch_hint=self.max_slots)

    def repack(self) -> None:
        """Make the packed copies of the weights again: call after changing the model's weights."""
        for fused in self._all_fused:
            fused.repack()

    def _logits(self, x_BE: torch.Tensor) -> torch.Tensor:
        (logits_BV,) = self._lm_head(self.inner.norm(x_BE))
        return logits_BV.float()

    # -- buffers -----------------------------------------------------------------------------

    def _ensure_capacity(self, length: int) -> None:
        """Grow every buffer (by doubling) so that a slot can hold `length` positions."""
        if length <= self.capacity:
            return
        cap = max(self.capacity, 1)
        while cap < length:
            cap *= 2
        cap = min(cap, self.max_model_len)
        assert cap >= length, f"length {length} exceeds max_model_len {self.max_model_len}"
        shape = (self.max_slots, self.num_kv_heads, cap, self.head_dim)
        layers = len(self.inner.layers)
        new_k = [
            torch.zeros(shape, device=self.device, dtype=self.cache_dtype) for _ in range(layers)
        ]
        new_v = [
            torch.zeros(shape, device=self.device, dtype=self.cache_dtype) for _ in range(layers)
        ]
        for old, new in zip(self.k + self.v, new_k + new_v, strict=False):
            new[:, :, : self.capacity].copy_(old)
        self.k, self.v, self.capacity = new_k, new_v, cap

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst`."""
        for buf in self.k + self.v:
            buf[dst, :, :length].copy_(buf[src, :, :length])

    def kv_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k + self.v)

    # -- forward -----------------------------------------------------------------------------

    def _layer(
        self,
        li: int,
        layer: Any,
        x_BTE: torch.Tensor,
        cos_BTD: torch.Tensor,
        sin_BTD: torch.Tensor,
        mask: torch.Tensor,
        cache: KVWriter,
    ) -> torch.Tensor:
        attn = layer.self_attn
        B, T, _ = x_BTE.shape
        h = layer.input_layernorm(x_BTE)
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in self._qkv[li](h))
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cd = self.cache_dtype
        q_BHTD = _rope(q.transpose(1, 2).to(cd), cos_BTD, sin_BTD)
        keys_BKLD, values_BKLD = cache(
            _rope(k.transpose(1, 2).to(cd), cos_BTD, sin_BTD), v.transpose(1, 2).to(cd)
        )
        out_BHTD = F.scaled_dot_product_attention(
            q_BHTD, keys_BKLD, values_BKLD, attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )
        (o_BTE,) = self._o[li](out_BHTD.transpose(1, 2).reshape(B, T, -1).to(self.dtype))
        x_BTE = x_BTE + o_BTE
        h = layer.post_attention_layernorm(x_BTE)
        mlp = self._mlp[li]
        mlp_BTE: torch.Tensor = layer.mlp(h) if mlp is None else gated_mlp(*mlp, h)
        return x_BTE + mlp_BTE

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Run `token_ids` at positions start.. of `slot`, whose first `start` positions are
        already cached; cache their keys/values and return the last position's logits [V]."""
        assert token_ids, "prefill needs at least one token"
        end = start + len(token_ids)
        self._ensure_capacity(end)
        dev = self.device
        x = self.inner.embed_tokens(torch.tensor([token_ids], device=dev))
        cos, sin = self.inner.rotary_emb(
            x.to(self.cache_dtype), torch.arange(start, end, device=dev)[None]
        )
        q_pos_T = torch.arange(start, end, device=dev)
        mask_TL = torch.arange(end, device=dev)[None, :] <= q_pos_T[:, None]
        for li, layer in enumerate(self.inner.layers):
            kb, vb = self.k[li], self.v[li]

            def cache(
                k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor = kb, vb: torch.Tensor = vb
            ) -> tuple[torch.Tensor, torch.Tensor]:
                kb[slot, :, start:end] = k[0]
                vb[slot, :, start:end] = v[0]
                return kb[slot : slot + 1, :, :end], vb[slot : slot + 1, :, :end]

            x = self._layer(li, layer, x, cos, sin, mask_TL, cache)
        return self._logits(x[:, -1])[0]

    @torch.inference_mode()
    def prefill_batch(self, first_slot: int, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill fresh sequences into slots first_slot, first_slot + 1, ... in one forward
        (right-padded to the longest); return each one's last-position logits [B, V]. Keys and
        values past a sequence's end are padding: decode masks them by position and overwrites
        them as the sequence grows."""
        assert prompts, "prefill needs at least one sequence"
        assert all(prompts), "prefill needs at least one token per sequence"
        B, dev = len(prompts), self.device
        lens_B = torch.tensor([len(p) for p in prompts], device=dev)
        T = int(lens_B.max())
        self._ensure_capacity(T)
        ids_BT = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids_BT[b, : len(p)] = torch.tensor(p, device=dev)
        pos_T = torch.arange(T, device=dev)
        x = self.inner.embed_tokens(ids_BT)
        cos, sin = self.inner.rotary_emb(x.to(self.cache_dtype), pos_T[None].expand(B, T))
        causal_TT = pos_T[None, :] <= pos_T[:, None]
        valid_BT = pos_T[None, :] < lens_B[:, None]
        mask_B1TT = (causal_TT[None] & valid_BT[:, None, :])[:, None]
        rows = slice(first_slot, first_slot + B)
        for li, layer in enumerate(self.inner.layers):
            kb, vb = self.k[li], self.v[li]

            def cache(
                k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor = kb, vb: torch.Tensor = vb
            ) -> tuple[torch.Tensor, torch.Tensor]:
                kb[rows, :, :T] = k
                vb[rows, :, :T] = v
                return k, v

            x = self._layer(li, layer, x, cos, sin, mask_B1TT, cache)
        last_BE = x[torch.arange(B, device=dev), lens_B - 1]
        return self._logits(last_BE)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for the sequences in slots 0..B-1: feed token_ids[b] at positions[b]
        of slot b, cache its keys/values, and return logits [B, V]."""
        B, L = len(token_ids), max(positions) + 1
        self._ensure_capacity(L)
        dev = self.device
        pos_B = torch.tensor(positions, device=dev)
        rows_B = torch.arange(B, device=dev)
        x = self.inner.embed_tokens(torch.tensor(token_ids, device=dev)[:, None])
        cos, sin = self.inner.rotary_emb(x.to(self.cache_dtype), pos_B[:, None])
        mask_B11L = (torch.arange(L, device=dev)[None, :] <= pos_B[:, None])[:, None, None]
        for li, layer in enumerate(self.inner.layers):
            kb, vb = self.k[li], self.v[li]

            def cache(
                k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor = kb, vb: torch.Tensor = vb
            ) -> tuple[torch.Tensor, torch.Tensor]:
                kb[rows_B, :, pos_B] = k[:, :, 0]
                vb[rows_B, :, pos_B] = v[:, :, 0]
                return kb[:B, :, :L], vb[:B, :, :L]

            x = self._layer(li, layer, x, cos, sin, mask_B11L, cache)
        return self._logits(x[:, 0])
