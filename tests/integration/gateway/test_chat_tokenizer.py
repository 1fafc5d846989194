"""The gateway's own tokenizer (`gateway/core/tokenizer.py`, `tokenizers` and `jinja2` alone)
answers as transformers' `AutoTokenizer` does on the same directory: every chat template the tests
know (each family's published one, over conversations with tools, calls, results, reasoning and
template arguments, and the templates' own refusals), and the tiny model's, SmolLM2's and a
WordPiece tokenizer's encoding, decoding, pieces, added tokens and special tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.core.tokenizer import ChatTokenizer, load_chat_tokenizer
from tests.support.paths import REPO_ROOT

SUPPORT = REPO_ROOT / "tests" / "support"
TEMPLATES = sorted([*(SUPPORT / "templates").glob("*.jinja"), SUPPORT / "qwen3_like.jinja"])

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Tōkyō", "days": 2}},
}
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], bool]] = {
    # name: (messages, with the tools)
    "one user turn": ([{"role": "user", "content": "Hello 👋"}], False),
    "system and turns": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 + 7?"},
            {"role": "assistant", "content": "19"},
            {"role": "user", "content": "And 3 * 4?"},
        ],
        False,
    ),
    "a call and its result": (
        [
            {"role": "user", "content": "Weather in Tōkyō?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        True,
    ),
    "reasoning": (
        [
            {"role": "user", "content": "Think, then answer."},
            {"role": "assistant", "content": "42", "reasoning_content": "6 * 7"},
            {"role": "user", "content": "Again."},
        ],
        True,
    ),
    "a system message after the first": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Late rules."},
            {"role": "user", "content": "Hi again"},
        ],
        False,
    ),
}


@pytest.fixture(scope="module")
def tiny_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer files, without its template (each test writes one)."""
    root = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, root / name)
    return root


def _render(tok: Any, messages: list[dict[str, Any]], tools: Any, **kw: Any) -> str:
    try:
        return str(tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw))
    except Exception as exc:  # the same refusal from both
        return f"raised {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_each_template_renders_as_transformers_does(
    template: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    shutil.copy(template, tmp_path / "chat_template.jinja")
    ours, theirs = load_chat_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == theirs.chat_template
    renders = 0
    for name, (messages, with_tools) in CONVERSATIONS.items():
        tools = TOOLS if with_tools else None
        for kw in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"add_generation_prompt": True, "enable_thinking": False, "eos_token": "<E>"},
        ):
            text = _render(ours, messages, tools, **kw)
            assert text == _render(theirs, messages, tools, **kw), (name, kw)
            renders += not text.startswith("raised ")
    assert renders >= 6, "most conversations render"


def test_a_template_in_the_config_and_named_templates(tiny_dir: Path, tmp_path: Path) -> None:
    """`tokenizer_config.json`'s `chat_template`, as a string or as named templates (the
    `default` one is used), as older saves write it."""
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    messages = CONVERSATIONS["system and turns"][0]
    for value in (template, [{"name": "default", "template": template}]):
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": value})
        )
        ours = load_chat_tokenizer(tmp_path)
        assert ours.chat_template == template
        theirs = AutoTokenizer.from_pretrained(str(tmp_path))
        assert _render(ours, messages, None) == _render(theirs, messages, None)
        assert _render(ours, messages, None).endswith("<|im_end|>")


def test_a_generation_block_renders_its_body(tiny_dir: Path, tmp_path: Path) -> None:
    """`{% generation %}` (templates that mark the assistant's tokens for training masks, e.g.
    SmolLM3's) is a block whose body renders unchanged, as in transformers."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    ours, theirs = load_chat_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    messages = CONVERSATIONS["system and turns"][0]
    assert _render(ours, messages, None) == _render(theirs, messages, None)
    assert _render(ours, messages, None) == (
        "<system>Be brief.<user>What is 12 + 7?<assistant>19<user>And 3 * 4?"
    )


def _same_tokenizer(ours: ChatTokenizer, theirs: Any, texts: list[str]) -> None:
    assert len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.clean_up_tokenization_spaces == theirs.clean_up_tokenization_spaces
    added = {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()}
    assert added == {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    for token_id in range(len(ours)):
        assert ours.convert_ids_to_tokens(token_id) == theirs.convert_ids_to_tokens(token_id)
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), text
    special = sorted(added)
    for start in range(0, len(ours) - 8, max(1, len(ours) // 97)):
        ids = [start, *special, start + 3, start + 7]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.decode(start) == theirs.decode(start)


TEXTS = [
    "What is 12 + 7? Answer with just the number.",
    "  leading and trailing spaces  \n\n tabs\there",
    "Tōkyō, naïve café, 東京, emoji 👋🏽 and a ZWJ 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "f", "arguments": {"n": 1234567}}\n</tool_call>',
    "don't, it's, we've, they're , ok . yes ? no !",
    "",
]


def test_the_tiny_models_tokenizer_answers_as_transformers(tiny_model: Path) -> None:
    _same_tokenizer(
        load_chat_tokenizer(tiny_model), AutoTokenizer.from_pretrained(str(tiny_model)), TEXTS
    )


@pytest.mark.slow
def test_smollm2s_tokenizer_answers_as_transformers() -> None:
    from engines.smollm2 import smollm2_dir

    root = smollm2_dir()
    ours, theirs = load_chat_tokenizer(root), AutoTokenizer.from_pretrained(str(root))
    _same_tokenizer(ours, theirs, TEXTS)
    messages = CONVERSATIONS["system and turns"][0]
    for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        assert _render(ours, messages, None, **kw) == _render(theirs, messages, None, **kw)
    assert _render(ours, messages[1:], None).startswith("<|im_start|>system\nYou are a helpful")


def test_a_wordpiece_tokenizer_cleans_up_spaces_as_transformers(tmp_path: Path) -> None:
    """The clean-up of tokenization spaces (`don 't` -> `don't`), which transformers applies
    where the config asks and the model is not BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = ["[UNK]", "[SEP]", "don", "'", "t", "n't", "it", "s", "ok", ".", "?", "yes", ","]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[SEP]"])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "clean_up_tokenization_spaces": True,
        "unk_token": "[UNK]",
        "sep_token": {"__type": "AddedToken", "content": "[SEP]", "special": True},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_chat_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    _same_tokenizer(ours, theirs, ["don't , it's ok . yes ?", "ok [SEP] yes"])
    assert ours.decode(ours.encode("ok . yes ?")) == "ok. yes?"
    assert ours.special_tokens_map == {"unk_token": "[UNK]", "sep_token": "[SEP]"}
