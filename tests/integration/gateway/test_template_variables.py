"""A request's `chat_template_kwargs` (vLLM's extension, taken on chat completions, the Responses
API and Messages alike) reach the model's chat template: `enable_thinking: false` renders Qwen3's
empty thinking block into the prompt that is recorded, the next turn under the same variables
continues the segment, under others opens a new one, and the rendering's own arguments are
refused in each protocol's error shape. In-process on the real local engine and SQLite."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer
from tests.support.admin_client import ADMIN
from tests.support.edge import Gw, edge_app, refused

THINKING_SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""Qwen3's switch: with `enable_thinking=False` the prompt holds an empty thinking block."""
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"


@pytest.fixture
async def gw(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> AsyncIterator[Gw]:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(THINKING_SWITCH)
    async with edge_app(engine, model, tmp_path) as g:
        yield g


async def segments(g: Gw) -> list[str]:
    r = await g.http.get(f"/sessions/{g.s['id']}", headers=ADMIN)
    tokenizer = load_tokenizer(g.model_dir)
    return [tokenizer.decode(seg["tokens"]) for seg in r.json()["segments"]]


async def ask(g: Gw, messages: list[dict[str, Any]], **variables: Any) -> str:
    body: dict[str, Any] = {"messages": messages, "max_tokens": 3, "seed": 0}
    if variables:
        body["chat_template_kwargs"] = variables
    r = await g.post("chat/completions", body)
    assert r.status_code == 200, r.text
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


async def test_template_variables_render_into_the_recorded_prompt(gw: Gw) -> None:
    first = [{"role": "user", "content": "quick: 2+2?"}]
    reply = await ask(gw, first, enable_thinking=False)
    (text,) = await segments(gw)
    assert text.startswith("<|im_start|>user\nquick: 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert EMPTY_THOUGHT in text
    # the same variables: the next turn continues the segment
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and 3+3?"},
    ]
    reply2 = await ask(gw, second, enable_thinking=False)
    (text,) = await segments(gw)
    assert text.count(EMPTY_THOUGHT) == 2
    # other variables render another prompt: a new segment, never a mixed one
    third = [*second, {"role": "assistant", "content": reply2}, {"role": "user", "content": "4+4?"}]
    await ask(gw, third)
    old, new = await segments(gw)
    assert old == text
    assert EMPTY_THOUGHT not in new


HI = [{"role": "user", "content": "hi"}]
OTHER_PROTOCOLS = {
    "responses": {"input": HI, "max_output_tokens": 3, "store": False},
    "messages": {"messages": HI, "max_tokens": 3},
}


@pytest.mark.parametrize("route", list(OTHER_PROTOCOLS))
async def test_the_responses_api_and_messages_take_them_too(gw: Gw, route: str) -> None:
    for variables in ({"enable_thinking": False}, {}):
        r = await gw.post(route, {**OTHER_PROTOCOLS[route], "chat_template_kwargs": variables})
        assert r.status_code == 200, r.text
    switched, plain = await segments(gw)
    assert EMPTY_THOUGHT in switched
    assert EMPTY_THOUGHT not in plain


async def test_the_renderings_own_arguments_are_refused(gw: Gw) -> None:
    for name in ("add_generation_prompt", "tokenize", "tools"):
        r = await gw.post("chat/completions", {"messages": HI, "chat_template_kwargs": {name: 1}})
        refused(r, 400, f"chat_template_kwargs.{name}", "the gateway sets")
        r = await gw.post(
            "responses", {**OTHER_PROTOCOLS["responses"], "chat_template_kwargs": {name: 1}}
        )
        refused(r, 400, f"chat_template_kwargs.{name}", "the gateway sets")
        r = await gw.post(
            "messages", {**OTHER_PROTOCOLS["messages"], "chat_template_kwargs": {name: 1}}
        )
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert f"chat_template_kwargs.{name}" in r.json()["error"]["message"]
    assert await gw.recorded() == []
