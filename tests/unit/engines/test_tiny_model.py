"""The tiny-model builder: determinism, loadability, tokenizer, chat template, and the cache."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from engines import tiny_model
from engines.tiny_model import (
    BUILDER_VERSION,
    TINY_MOE,
    TINY_SIZES,
    build_tiny_model,
    load_tokenizer,
    tiny_model_dir,
)

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    tiny_model.MARKER_FILE,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

# An agent episode: two parallel tool calls (arguments as a JSON string and as a dict), their
# grouped results, a final answer, and a second user turn.
EPISODE: list[dict[str, Any]] = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3 and 4+5?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 4, "b": 5}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9"},
    {"role": "assistant", "content": "5 and 9."},
    {"role": "user", "content": "Thanks! 🎉"},
    {"role": "assistant", "content": "You're welcome."},
]

EPISODE_TEXT = (
    "<|im_start|>system\nYou add numbers.\n\n"
    + TOOLS_SYSTEM_PROMPT
    + "<|im_start|>user\nWhat is 2+3 and 4+5?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
    "<tool_response>\n9\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n5 and 9.<|im_end|>\n"
    "<|im_start|>user\nThanks! 🎉<|im_end|>\n"
    "<|im_start|>assistant\nYou're welcome.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-moe") / "model", moe=True)


def render(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **kwargs: Any
) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def test_same_seed_gives_byte_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    assert {p.name for p in model_dir.iterdir()} == EXPECTED_FILES
    assert {p.name for p in again.iterdir()} == EXPECTED_FILES
    for name in EXPECTED_FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_different_seeds_give_different_weights(model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    weights0 = load_file(model_dir / "model.safetensors")
    weights1 = load_file(other / "model.safetensors")
    assert weights0.keys() == weights1.keys()
    for name, tensor in weights0.items():
        assert tensor.dtype == torch.float32
        assert not torch.equal(tensor, weights1[name]), name
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    before = torch.get_rng_state()
    build_tiny_model(tmp_path / "model", seed=7)
    assert torch.equal(torch.get_rng_state(), before)


def test_model_loads_as_untied_qwen2_with_finite_spread_logits(
    model_dir: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert config.model_type == "qwen2"
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert config.hidden_size // config.num_attention_heads >= 32
    assert config.vocab_size == len(tokenizer) == 256 + 7
    assert config.max_position_embeddings == 2048
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert model.dtype == torch.float32

    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    # Not degenerate: logits spread over the vocabulary and depend on the context.
    assert logits.std(dim=-1).min() > 0.5
    assert logits.argmax(dim=-1).unique().numel() > 3


def test_sizes_have_valid_shapes(tmp_path: Path) -> None:
    assert set(TINY_SIZES) == {"test", "demo"}
    assert TINY_SIZES["test"].hidden_size == 128
    assert all(size.head_dim >= 32 for size in TINY_SIZES.values())
    assert TINY_MOE.keys() == TINY_SIZES.keys()
    assert all(m.num_experts >= 4 and m.num_experts_per_tok == 2 for m in TINY_MOE.values())
    demo = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "demo", size="demo"))
    assert 1_000_000 < demo.num_parameters() < 10_000_000


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "  leading and trailing spaces  ",
        "line one\nline two\r\n\n\ttabbed",
        "héllo wörld, naïve café",
        "日本語のテキスト",
        "emoji 🎉👍🏽 and flags 🇫🇷",
        '{"name": "add", "arguments": {"a": 1}}',
        "<|im_start|>user\nhi<|im_end|>\n<tool_call>x</tool_call><think>y</think>",
    ],
)
def test_tokenizer_round_trips_text(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_is_bytes_plus_added_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ascii_text = "Any ASCII: ~!@# 123 abc\n"
    assert tokenizer.encode(ascii_text) == list(ascii_text.encode())
    assert tokenizer.encode("é") == list("é".encode())
    # Text is NFC-normalized first, as transformers' Qwen2Tokenizer always does.
    assert tokenizer.decode(tokenizer.encode("e\u0301")) == unicodedata.normalize("NFC", "e\u0301")


@pytest.mark.parametrize(
    ("token", "special"),
    [
        ("<|endoftext|>", True),
        ("<|im_start|>", True),
        ("<|im_end|>", True),
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<think>", False),
        ("</think>", False),
    ],
)
def test_added_tokens_are_single_ids(
    tokenizer: PreTrainedTokenizerFast, token: str, special: bool
) -> None:
    ids = tokenizer.encode(token)
    assert len(ids) == 1
    assert ids[0] >= 256
    assert (token in tokenizer.all_special_tokens) is special
    assert tokenizer.decode(ids, skip_special_tokens=True) == ("" if special else token)


def test_special_token_roles(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 2048


def test_generation_config_eos_ids(model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    gen = GenerationConfig.from_pretrained(model_dir)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen.eos_token_id == [im_end, endoftext]
    assert gen.pad_token_id == endoftext
    assert gen.bos_token_id is None


def test_chat_template_renders_plain_chat(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_has_no_implicit_system_message(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages) == "<|im_start|>user\nHi<|im_end|>\n"
    assert render(tokenizer, messages, tools=TOOLS) == (
        "<|im_start|>system\n" + TOOLS_SYSTEM_PROMPT + "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chat_template_renders_tools_tool_calls_and_tool_responses(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    assert render(tokenizer, EPISODE, tools=TOOLS) == EPISODE_TEXT
    ids = tokenizer.apply_chat_template(EPISODE, tools=TOOLS, add_generation_prompt=True)[
        "input_ids"
    ]
    assert ids == tokenizer.encode(EPISODE_TEXT + "<|im_start|>assistant\n")
    # Two in the tool instructions of the system turn, one per call.
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_call>")) == 2 + 2
    assert ids.count(tokenizer.convert_tokens_to_ids("</tool_call>")) == 2 + 2


def test_chat_template_renders_assistant_text_before_tool_calls(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    call = {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "assistant", "content": "Let me add.", "tool_calls": [call]}]
    assert render(tokenizer, messages) == (
        "<|im_start|>assistant\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
    )


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_is_append_only(
    tokenizer: PreTrainedTokenizerFast, tools: list[dict[str, Any]] | None
) -> None:
    full = render(tokenizer, EPISODE, tools=tools)
    full_ids = tokenizer.encode(full)
    for k in range(1, len(EPISODE)):
        if EPISODE[k - 1]["role"] == EPISODE[k]["role"] == "tool":
            continue  # consecutive tool results share one user turn, as in Qwen2.5
        prefix = render(tokenizer, EPISODE[:k], tools=tools)
        assert full.startswith(prefix), k
        assert full_ids[: len(tokenizer.encode(prefix))] == tokenizer.encode(prefix), k
        if EPISODE[k]["role"] == "assistant":
            # What the engine continues from is a prefix of the turn it produced.
            prompt = render(tokenizer, EPISODE[:k], tools=tools, add_generation_prompt=True)
            assert full.startswith(prompt), k


def test_build_refuses_a_foreign_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny-model build"):
        build_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_build_overwrites_a_previous_build(model_dir: Path, tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "model", seed=1)
    build_tiny_model(out, seed=0)
    for name in EXPECTED_FILES:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name


@pytest.mark.parametrize("call", [build_tiny_model, tiny_model_dir])
def test_bad_size_is_a_value_error(call: Any, tmp_path: Path) -> None:
    kwargs = {"out_dir": tmp_path / "m"} if call is build_tiny_model else {}
    with pytest.raises(ValueError, match=r"'huge'.*\['demo', 'test'\]"):
        call(size="huge", **kwargs)


def test_tiny_model_dir_builds_once_into_the_cache(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLGATEWAY_CACHE_DIR", str(tmp_path))
    first = tiny_model_dir()
    assert first == tmp_path / "models" / f"tiny-test-seed0-v{BUILDER_VERSION}"
    assert (first / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("the cached build was rebuilt")

    monkeypatch.setattr(tiny_model, "build_tiny_model", no_rebuild)
    assert tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_tiny_model_dir_uses_the_build_that_won_a_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLGATEWAY_CACHE_DIR", str(tmp_path))
    final = tmp_path / "models" / f"tiny-test-seed2-v{BUILDER_VERSION}"
    real_build = tiny_model.build_tiny_model

    def build_after_another_process(out_dir: Path, **kwargs: Any) -> Path:
        real_build(final, **kwargs)  # another process finishes first
        return real_build(out_dir, **kwargs)

    monkeypatch.setattr(tiny_model, "build_tiny_model", build_after_another_process)
    assert tiny_model_dir(seed=2) == final
    assert (final / tiny_model.MARKER_FILE).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [final.name]  # loser cleaned up


def test_moe_build_is_deterministic_and_shares_the_dense_tokenizer(
    moe_dir: Path, model_dir: Path, tmp_path: Path
) -> None:
    again = build_tiny_model(tmp_path / "again", moe=True)
    assert {p.name for p in again.iterdir()} == EXPECTED_FILES
    for name in EXPECTED_FILES:
        assert (again / name).read_bytes() == (moe_dir / name).read_bytes(), name
    shared = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for name in (*shared, "generation_config.json"):
        assert (moe_dir / name).read_bytes() == (model_dir / name).read_bytes(), name
    weights0 = load_file(moe_dir / "model.safetensors")
    other = build_tiny_model(tmp_path / "seed1", seed=1, moe=True)
    weights1 = load_file(other / "model.safetensors")
    assert weights0.keys() == weights1.keys()
    for name, tensor in weights0.items():
        assert tensor.dtype == torch.float32
        assert not torch.equal(tensor, weights1[name]), name


def test_moe_model_loads_as_untied_qwen3_moe_that_routes_by_token(
    moe_dir: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == TINY_MOE["test"].moe_intermediate_size
    assert (config.decoder_sparse_step, config.mlp_only_layers) == (1, [])
    assert config.norm_topk_prob is True
    assert config.output_router_logits is False
    assert config._experts_implementation == tiny_model.MOE_EXPERTS_IMPLEMENTATION
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert config.hidden_size // config.num_attention_heads >= 32
    assert config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    saved = json.loads((moe_dir / "config.json").read_text())
    assert (saved["num_experts"], saved["experts_implementation"]) == (4, "eager")
    marker = json.loads((moe_dir / tiny_model.MARKER_FILE).read_text())
    assert marker["moe"] == dataclasses.asdict(TINY_MOE["test"])

    ids = torch.tensor([tokenizer.encode(bytes(range(32, 127)).decode())])  # printable ASCII
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std(dim=-1).min() > 0.5
    assert len(out.router_logits) == config.num_hidden_layers
    for router_TE in out.router_logits:
        chosen = router_TE.topk(2, dim=-1).indices.sort(dim=-1).values
        assert chosen.unique().numel() == 4  # every expert serves some token
        assert chosen.unique(dim=0).shape[0] > 2  # and tokens pick different pairs


def test_moe_model_trains_on_cpu_in_float32(moe_dir: Path) -> None:
    """Forward and backward run with the experts implementation the config names."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    ids = torch.tensor([list(b"a few bytes of text"), list(b"and another sequence")[:19]])
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    for layer in model.model.layers:
        assert layer.mlp.experts.gate_up_proj.grad.abs().sum(dim=(1, 2)).min() > 0
        assert layer.mlp.gate.weight.grad.abs().sum() > 0


def test_tiny_model_dir_caches_the_moe_build_apart(
    moe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLGATEWAY_CACHE_DIR", str(tmp_path))
    moe = tiny_model_dir(moe=True)
    assert moe == tmp_path / "models" / f"tiny-moe-test-seed0-v{BUILDER_VERSION}"
    assert (moe / "model.safetensors").read_bytes() == (moe_dir / "model.safetensors").read_bytes()
    assert tiny_model_dir(moe=True) == moe
    assert tiny_model_dir() != moe
