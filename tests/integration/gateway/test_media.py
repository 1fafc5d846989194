"""Images, documents and files in a request's messages, as the run says (`media`): by default a
400 naming the part, in every protocol and inside a tool result; with `media: placeholder` each
part is rendered as `[image omitted]` (and the like), recorded as context, and the agent's next
turn, which sends the same history again, continues the same segment token for token. In-process
on the real local engine and a real SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer
from tests.support.admin_client import ADMIN
from tests.support.edge import Gw, edge_app, refused

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
CHAT_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
READ = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
TOOL = {"name": "Read", "input_schema": {"type": "object"}}


def picture_turn(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, CHAT_IMAGE]}


@pytest.fixture
async def refusing(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> AsyncIterator[Gw]:
    async with edge_app(engine, tiny_model, tmp_path) as g:
        yield g


@pytest.fixture
async def placeholders(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> AsyncIterator[Gw]:
    async with edge_app(engine, tiny_model, tmp_path, {"media": "placeholder"}) as g:
        yield g


async def test_by_default_a_media_part_is_a_400_naming_it(refusing: Gw) -> None:
    g = refusing
    r = await g.post("chat/completions", {"messages": [picture_turn("what is this?")]})
    refused(r, 400, "messages.0.content.1", "media: placeholder")
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    r = await g.post("responses", {"input": [{"role": "user", "content": [image]}]})
    refused(r, 400, "input.0.content.0", "media: placeholder")
    claude = [
        {"role": "user", "content": "look at a.png"},
        {"role": "assistant", "content": [READ]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "image", "source": PNG}],
                },
            ],
        },
    ]
    r = await g.post("messages", {"max_tokens": 2, "messages": claude, "tools": [TOOL]})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert "messages.2.content.0.content.0" in r.json()["error"]["message"]
    assert await g.recorded() == []
    await g.still_serves()


async def prompt_text(g: Gw, tiny_model: Path) -> list[str]:
    """Each segment's tokens as text."""
    r = await g.http.get(f"/sessions/{g.s['id']}", headers=ADMIN)
    tokenizer = load_tokenizer(tiny_model)
    return [tokenizer.decode(seg["tokens"]) for seg in r.json()["segments"]]


async def test_with_placeholders_a_chat_with_a_picture_goes_on_in_one_segment(
    placeholders: Gw, tiny_model: Path
) -> None:
    g = placeholders
    first = [picture_turn("what is this?")]
    r = await g.post("chat/completions", {"messages": first, "max_tokens": 3, "seed": 1})
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]["content"]
    (text,) = await prompt_text(g, tiny_model)
    assert "what is this?[image omitted]" in text
    # the agent's next turn sends the picture again, with another: one segment, extended
    second = [*first, {"role": "assistant", "content": reply}, picture_turn("and this?")]
    r = await g.post("chat/completions", {"messages": second, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert len(await g.recorded()) == 1, "the history with its picture continues the segment"
    (text,) = await prompt_text(g, tiny_model)
    assert text.count("[image omitted]") == 2


async def test_with_placeholders_claude_code_reading_a_png_goes_on(
    placeholders: Gw, tiny_model: Path
) -> None:
    """Claude Code's Read of a picture: the tool result holds an image block; a document in a
    user message too. count_tokens renders as the turn does."""
    g = placeholders
    claude = [
        {"role": "user", "content": "look at a.png"},
        {"role": "assistant", "content": [READ]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "image", "source": PNG}],
                },
                {"type": "document", "source": {"type": "text", "data": "notes"}},
            ],
        },
    ]
    body = {"max_tokens": 2, "messages": claude, "tools": [TOOL]}
    counted = await g.post("messages/count_tokens", body)
    assert counted.status_code == 200, counted.text
    r = await g.post("messages", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == counted.json()["input_tokens"]
    (text,) = await prompt_text(g, tiny_model)
    assert "[image omitted]" in text
    assert "[document omitted]" in text


async def test_with_placeholders_a_responses_chain_with_a_picture_goes_on(
    placeholders: Gw, tiny_model: Path
) -> None:
    g = placeholders
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "what?"}, image]}]
    r = await g.post("responses", {"input": ask, "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    r = await g.post(
        "responses",
        {"input": "and now?", "previous_response_id": r.json()["id"], "max_output_tokens": 3},
    )
    assert r.status_code == 200, r.text
    assert len(await g.recorded()) == 1
    (text,) = await prompt_text(g, tiny_model)
    assert text.count("[image omitted]") == 1
    await g.still_serves()
