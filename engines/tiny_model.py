"""Builds the tiny models that every test and the CPU demo use: from a seed, with no network.

The directory is an ordinary Hugging Face model that transformers and vLLM both load:

- Tokenizer: byte-level BPE whose vocabulary is exactly the 256 byte symbols and which has no
  merges, so token id == byte value and each ASCII character is one token. Text is NFC-normalized
  first (transformers loads any qwen2 tokenizer as `Qwen2Tokenizer`, which always does that), so
  any NFC text round-trips through encode and decode. After the bytes come the ChatML specials
  (`<|endoftext|>` pad, `<|im_start|>`, `<|im_end|>` eos) and the Qwen2.5-style plain added tokens
  `<tool_call>`, `</tool_call>`, `<think>`, `</think>`, each a single id. The chat template is
  `chat_template.jinja` beside this module (ChatML with Qwen2.5 tool calls, no implicit system
  message).
- Model: `Qwen2ForCausalLM`, float32, untied embeddings (vLLM's in-place weight reload is wrong for
  tied ones), attention head_dim >= 32 (the smallest vLLM's CPU attention accepts), and
  `vocab_size == len(tokenizer)`.
- With `moe=True`: `Qwen3MoeForCausalLM` of the same size, tokenizer and conventions, every layer
  a sparse block of `TINY_MOE[size]` experts with top-k routing (renormalised top-k weights, as
  Qwen3-30B-A3B). Its `config.json` names the `eager` experts implementation (a loop over the
  experts a batch hits), which transformers reads on load. The default, `grouped_mm`, runs
  torch's grouped matmul on CPU too (transformers 5.0 calls `torch._grouped_mm` with no CPU
  check), whose float32 backward on CPU (torch 2.13) raises "Invalid strides/sizes" for some
  gradient layouts, such as an expanded one; eager is plain matmuls, forward and backward.
  transformers' `save_pretrained` does not write the setting, so the builder adds it to the saved
  file. It also writes the expert count as `num_experts`, as Qwen3-MoE checkpoints do, rather
  than `num_local_experts` (the name transformers 5.19 saves), which transformers 5.0 ignores.
- Weights come from a private `torch.Generator` seeded with `seed`, so the global RNG is left alone
  and the same seed gives byte-identical files. The output head is scaled so that logits spread
  over about one nat; norm weights and biases are random too, so that a weight loader that skips
  them gives visibly different logits. Router weights are scaled like the output head, so that
  routing is decisive (router logits with a std of about 1) and depends on the token.

`tiny_model_dir` builds each (size, seed, moe) once into a cache shared by concurrent processes: it
builds into a private temporary directory beside the target and renames it into place, so readers
only ever see complete builds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BUILDER_VERSION = 1
"""Bump whenever the built files change, so that cached builds are not reused."""

MARKER_FILE = "rlgateway_tiny_model.json"
"""Written last into every build; names the builder version, size, seed and max_model_len (and
the expert layout of a MoE build)."""

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

_WEIGHT_STD = 0.02
_NORM_WEIGHT_STD = 0.1
MOE_EXPERTS_IMPLEMENTATION = "eager"
"""The experts implementation a MoE build's config names (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class TinySize:
    """The shape of a tiny Qwen2. `hidden_size / num_attention_heads` (head_dim) is at least 32."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 32:
            raise ValueError(f"head_dim is {self.head_dim}; vLLM's CPU attention needs >= 32")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


TINY_SIZES: dict[str, TinySize] = {
    "test": TinySize(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=384,
    ),
    "demo": TinySize(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
    ),
}


@dataclass(frozen=True, slots=True)
class TinyMoe:
    """The expert layout of a tiny Qwen3-MoE: every layer is sparse, `num_experts_per_tok` of
    `num_experts` experts (each with `moe_intermediate_size` hidden units) per token."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int

    def __post_init__(self) -> None:
        if not 2 <= self.num_experts_per_tok < self.num_experts:
            raise ValueError("num_experts_per_tok must be at least 2 and below num_experts")


TINY_MOE: dict[str, TinyMoe] = {
    "test": TinyMoe(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192),
    "demo": TinyMoe(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384),
}
"""The expert layout of the MoE build of each size; the rest of its shape is `TINY_SIZES[size]`."""


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    size: str = "test",
    max_model_len: int = 2048,
    moe: bool = False,
) -> Path:
    """Writes the tiny model of `size` with weights from `seed` into `out_dir` and returns it: a
    Qwen2, or with `moe` a Qwen3-MoE.

    `out_dir` must be missing, empty, or a previous build (which is overwritten). The same
    arguments give byte-identical files.
    """
    spec = _tiny_size(size)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    out = empty_or_own_dir(out_dir, MARKER_FILE, "a tiny-model build")

    tokenizer = _build_tokenizer(max_model_len)
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": max_model_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": _token_id(tokenizer, EOS_TOKEN),
        "pad_token_id": _token_id(tokenizer, PAD_TOKEN),
        "dtype": "float32",
    }
    marker = {"builder_version": BUILDER_VERSION, "size": size, "seed": seed}
    marker |= {"max_model_len": max_model_len, "shape": asdict(spec)}
    model: PreTrainedModel
    if moe:
        experts = TINY_MOE[size]
        config: PretrainedConfig = Qwen3MoeConfig(
            **common,
            num_experts=experts.num_experts,
            num_experts_per_tok=experts.num_experts_per_tok,
            moe_intermediate_size=experts.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
        model = _build_model(Qwen3MoeForCausalLM, config, seed)
        marker["moe"] = asdict(experts)
    else:
        model = _build_model(Qwen2ForCausalLM, Qwen2Config(**common), seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if moe:
        saved = json.loads((out / "config.json").read_text())
        saved["num_experts"] = saved.pop("num_local_experts")
        saved["experts_implementation"] = MOE_EXPERTS_IMPLEMENTATION
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return out


def empty_or_own_dir(out_dir: str | Path, marker: str, kind: str) -> Path:
    """`out_dir`, created if missing; refused (FileExistsError) when it holds files and is not
    an earlier build of this `kind` (marked by `marker`), which is rebuilt in place."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / marker).is_file():
        raise FileExistsError(
            f"{out} exists, is not empty and is not {kind}: "
            "pass a new or empty directory, or remove this one"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def tiny_model_dir(*, size: str = "test", seed: int = 0, moe: bool = False) -> Path:
    """Returns the cached build of the tiny model of `size`, `seed` and `moe`, building it on first
    use (in `models_cache_dir()`; safe for concurrent processes, see `cached_build`)."""
    _tiny_size(size)
    kind = "tiny-moe" if moe else "tiny"
    final = models_cache_dir() / f"{kind}-{size}-seed{seed}-v{BUILDER_VERSION}"
    return cached_build(
        final, MARKER_FILE, lambda tmp: build_tiny_model(tmp, seed=seed, size=size, moe=moe)
    )


def models_cache_dir() -> Path:
    """`$RLGATEWAY_CACHE_DIR/models` (default `~/.cache/rlgateway/models`): where built models are
    cached, on a machine and (where CI keeps that directory) between runs."""
    root = os.environ.get("RLGATEWAY_CACHE_DIR") or Path.home() / ".cache" / "rlgateway"
    return Path(root) / "models"


def cached_build(final: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """Returns `final`, first running `build` (which writes a model into the directory it is
    given, `marker` last) unless `final / marker` exists.

    Safe to call from concurrent processes: each builds into a private temporary directory beside
    `final` and renames it into place; the first rename wins, and readers only ever see complete
    builds.
    """
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the build is meant to be shared
        try:
            tmp.rename(final)
        except OSError as err:
            # Another process renamed its build into place first: use theirs.
            if not (final / marker).is_file():
                raise FileExistsError(f"{final} is not a complete build: remove it") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """Loads the tokenizer of a model directory (a tiny build or any other)."""
    return cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(str(model_dir)))


def _tiny_size(size: str) -> TinySize:
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; valid sizes: {sorted(TINY_SIZES)}")
    return TINY_SIZES[size]


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), token
    return token_id


def _byte_symbols() -> list[str]:
    """The ByteLevel symbol of each byte value, indexed by byte (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in symbols)
    symbols |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return [symbols[b] for b in range(256)]


def _build_tokenizer(max_model_len: int) -> PreTrainedTokenizerFast:
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # transformers loads every qwen2 model's tokenizer as `Qwen2Tokenizer`, which always applies
    # NFC; the file says so too, so that every loader agrees.
    tok.normalizer = normalizers.NFC()
    # No regex split: with no merges, pre-splitting changes nothing but the cost.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    template = resources.files("engines").joinpath("chat_template.jinja").read_text("utf-8")
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=max_model_len,
        clean_up_tokenization_spaces=False,  # decode must be the exact inverse of encode
        chat_template=template,
    )


def _build_model(
    model_class: type[PreTrainedModel], config: PretrainedConfig, seed: int
) -> PreTrainedModel:
    # Construction runs transformers' own init on the global RNG; fork_rng keeps it untouched.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    gen = torch.Generator().manual_seed(seed)
    head_std = 1.0 / math.sqrt(config.hidden_size)  # logits with a std of about 1
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + _NORM_WEIGHT_STD * noise)
            elif name == "lm_head.weight" or name.endswith("mlp.gate.weight"):
                param.copy_(head_std * noise)
            else:
                param.copy_(_WEIGHT_STD * noise)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=None,
        eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
    )
    return model
