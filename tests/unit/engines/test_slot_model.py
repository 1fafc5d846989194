"""The local engine's own forward (slot KV cache) against the transformers model's forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from engines.slot_model import SlotModel


def _model(kind: str) -> Any:
    from transformers import AutoModelForCausalLM

    common: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    configs = {
        "qwen2": Qwen2Config(**common),
        "qwen3": Qwen3Config(**common, head_dim=32),
        "llama": LlamaConfig(**common),
        # transformers' default experts implementation, as a downloaded checkpoint gets it
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    }
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(configs[kind]).eval()


def _ref_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_prefill_extend_and_batched_decode_match_the_model(kind: str, packed: bool) -> None:
    model = _model(kind)
    runner = SlotModel(model, max_slots=4, max_model_len=256, packed=packed)
    assert runner.packed is packed
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (6, 11, 40)]
    for slot, seq in enumerate(seqs):
        logits = runner.prefill(slot, seq[:-4])
        assert torch.allclose(logits, _ref_logits(model, seq[:-4])[-1], atol=1e-5)
    for back in (4, 3, 2, 1):
        pos = [len(s) - back for s in seqs]
        logits = runner.decode([s[p] for s, p in zip(seqs, pos, strict=True)], pos)
        for b, seq in enumerate(seqs):
            ref = _ref_logits(model, seq[: pos[b] + 1])[-1]
            assert torch.allclose(logits[b], ref, atol=1e-5)
    # extend a cached prefix by a chunk
    runner.prefill(3, seqs[2][:25])
    logits = runner.prefill(3, seqs[2][25:31], start=25)
    assert torch.allclose(logits, _ref_logits(model, seqs[2][:31])[-1], atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_batched_prefill_of_uneven_prompts_matches_the_model(kind: str) -> None:
    model = _model(kind)
    runner = SlotModel(model, max_slots=6, max_model_len=512)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 17, 1, 9)]
    logits = runner.prefill_batch(2, [s[:-1] or s for s in seqs])
    for b, seq in enumerate(seqs):
        prompt = seq[:-1] or seq
        assert torch.allclose(logits[b], _ref_logits(model, prompt)[-1], atol=1e-5)
    # decoding continues from the batched prefill, slot by slot, past the padding
    logits = runner.decode(
        [0, 0] + [s[-1] for s in seqs], [0, 0] + [len(s[:-1] or s) for s in seqs]
    )
    for b, seq in enumerate(seqs):
        full = (seq[:-1] or seq) + [seq[-1]]
        assert torch.allclose(logits[2 + b], _ref_logits(model, full)[-1], atol=1e-5)


def test_packed_weights_are_made_again_after_the_model_changes() -> None:
    model = _model("qwen2")
    runner = SlotModel(model, max_slots=2, max_model_len=64)
    assert runner.packed, "oneDNN runs on this CPU: the engine packs its weights"
    seq = list(range(1, 20))
    before = runner.prefill(0, seq)
    with torch.no_grad():  # every projection changes; norms and embeddings stay
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(1.5)
    assert torch.equal(runner.prefill(0, seq), before)  # the packed copies are the old weights
    runner.repack()
    after = runner.prefill(0, seq)
    assert torch.allclose(after, _ref_logits(model, seq)[-1], atol=1e-4)
    assert not torch.allclose(after, before, atol=1e-2)


def test_buffers_grow_and_slots_move() -> None:
    model = _model("qwen2")
    runner = SlotModel(model, max_slots=2, max_model_len=400)
    start = runner.capacity
    seq = (list(range(1, 97)) * 4)[:300]
    runner.prefill(1, seq[:-1])
    assert start < 299 <= runner.capacity
    runner.move_slot(1, 0, len(seq) - 1)
    logits = runner.decode([seq[-1]], [len(seq) - 1])
    assert torch.allclose(logits[0], _ref_logits(model, seq)[-1], atol=1e-5)


def test_unsupported_architecture_is_refused_with_advice() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="--engine vllm"):
        SlotModel(model, max_slots=1, max_model_len=64)
