"""A segment's continuation: its exact tokens, the end-of-turn glue, then what the template writes
for the new messages, for a template that is append-only (the tiny model's ChatML) and for one
that re-renders earlier turns once a new user message follows (as Qwen3's drops their
reasoning)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from engines.tiny_model import load_tokenizer
from gateway.core.chat_render import ChatRenderer
from tests.support.paths import SUPPORT

QWEN3_LIKE = (SUPPORT / "qwen3_like.jinja").read_text()
Q1 = {"role": "user", "content": "Q1"}
REPLY = {"role": "assistant", "content": "A1", "reasoning_content": "R1"}
Q2 = {"role": "user", "content": "Q2"}


@pytest.fixture
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def renderer(tokenizer: Any, template: str | None = None) -> ChatRenderer:
    if template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return ChatRenderer(tokenizer, frozenset({im_end}))


def segment(r: ChatRenderer, sampled_text: str) -> list[int]:
    """The first turn's tokens: the prompt of Q1, the sampled reply and its end token."""
    im_end = next(iter(r.eos_token_ids))
    return [*r.prompt([Q1], None), *r.encode(sampled_text), im_end]


def test_an_append_only_template_continues_with_the_new_messages(tokenizer: Any) -> None:
    r = renderer(tokenizer)
    seg = segment(r, "A1")
    reply = {"role": "assistant", "content": "A1"}
    got = r.continuation(seg, [Q1, reply], [Q1, reply, Q2], None)
    assert got == seg + r.encode("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rerenders_earlier_turns_still_continues_the_segment(
    tokenizer: Any,
) -> None:
    r = renderer(tokenizer, QWEN3_LIKE)
    before = r.render([Q1, REPLY], None, add_generation_prompt=False)
    full = r.render([Q1, REPLY, Q2], None, add_generation_prompt=True)
    assert not full.startswith(before), "the template re-renders turn 1: this test proves nothing"
    seg = segment(r, "<think>\nR1\n</think>\n\nA1")
    got = r.continuation(seg, [Q1, REPLY], [Q1, REPLY, Q2], None)
    # the sampled reasoning stays, exactly; the new user turn is what the template writes
    assert got == seg + r.encode("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
