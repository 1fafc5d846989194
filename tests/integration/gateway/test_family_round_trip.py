"""Each model family's tool calls round-trip through chat completions, the Responses API and
Messages, on the family's own chat template (`tests/support/templates/`, as its model card
publishes it; Mistral's a template of the tests' own with its published id rule) and its parser,
with the family's own call ids where its template writes them back (Kimi-K2, Mistral): a forced
call comes back as the protocol's tool call with arguments valid against the tool's schema (held
by the family's grammar, so even the random tiny model writes one), and the history sent back with
the tool's result continues the same segment token for token: the gateway renders only what the
template writes after the segment's last turn, so this holds even where the template writes
earlier calls otherwise than the model made them (Granite 3.3's drops them, Phi-4-mini's renders
Python reprs). In-process on the real local engine (the tiny model's vocabulary under each
family's template) and a real SQLite store."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engines.local import LocalEngine
from tests.support.admin_client import ADMIN
from tests.support.edge import Gw, edge_app
from tests.support.paths import REPO_ROOT
from tests.support.round_trip import Post, send_result, tools_in

TEMPLATES = REPO_ROOT / "tests" / "support" / "templates"
FAMILIES = [
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "glm45",
    "minimax_m2",
    "deepseek_v31",
    "granite",
    "phi4_mini_json",
    "kimi_k2",
    "mistral",  # a Mistral-style template of the tests' own, refusing ids not 9 characters long
    "gpt_oss",
]
"""Every parser whose forced calls a grammar holds, under its family's template (hermes under the
tiny model's own, Qwen2.5's format), but Llama-4's: its template's instructions alone outgrow the
tiny model's 2,048-token context (its grammar is held in `tests/unit/engines/test_tool_grammars.py`
on the engine)."""
PARSER = {"gpt_oss": "openai"}
"""The tool parser of a family named otherwise (vLLM's names)."""
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
DESCRIPTION = "The weather in a city."
"""gpt-oss's template refuses a tool without a description."""
CHAT_TOOLS = tools_in("chat/completions", "get_weather", DESCRIPTION, SCHEMA)
ASK = {"role": "user", "content": "Weather in Paris?"}
ROOM = 200
"""New tokens for a call: the tiny tokenizer writes markup about a character a token (and the
tools' declaration takes most of its 2,048-token context)."""


def family_dir(tiny_model: Path, family: str, tmp_path: Path) -> Path:
    """The tiny model's tokenizer under the family's chat template."""
    if family == "hermes":
        return tiny_model
    out = tmp_path / family
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out / name)
    shutil.copy(TEMPLATES / f"{family}.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(params=FAMILIES)
async def g(
    request: pytest.FixtureRequest,
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> Any:
    model_dir = family_dir(tiny_model, request.param, tmp_path)
    parser = PARSER.get(request.param, request.param)
    async with edge_app(engine, model_dir, tmp_path, tool_parser=parser) as g:
        g.family = request.param
        yield g


async def post(g: Gw, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await g.http.post(f"/sessions/{g.s['id']}/v1/{route}", json=body, headers=g.key)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def poster(g: Gw) -> Post:
    return functools.partial(post, g)


def valid(arguments: Any) -> None:
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMA)


def own_id(g: Gw, call_id: str) -> None:
    """The family's own call ids, which the client gets as they are and sends back with the
    result: Kimi-K2's as the model wrote them (`functions.NAME:IDX`), Mistral's nine letters and
    digits (its templates refuse any other)."""
    if g.family == "kimi_k2":
        assert call_id.startswith("functions.get_weather:"), call_id
    if g.family == "mistral":
        assert len(call_id) == 9, call_id
        assert call_id.isalnum(), call_id


async def chat(g: Gw) -> list[str]:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = await post(
        g,
        "chat/completions",
        {"messages": [ASK], "tools": CHAT_TOOLS, "tool_choice": forced, "max_tokens": ROOM},
    )
    message = first["choices"][0]["message"]
    assert len(message.get("tool_calls") or []) == 1, first
    [call] = message["tool_calls"]
    valid(call["function"]["arguments"])
    own_id(g, call["id"])
    return [first["id"], await send_result(poster(g), "chat/completions", ASK, first, CHAT_TOOLS)]


async def responses(g: Gw) -> list[str]:
    tools = tools_in("responses", "get_weather", DESCRIPTION, SCHEMA)
    forced = {"type": "function", "name": "get_weather"}
    first = await post(
        g,
        "responses",
        {"input": [ASK], "tools": tools, "tool_choice": forced, "max_output_tokens": ROOM},
    )
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert len(calls) == 1, first
    [call] = calls
    valid(call["arguments"])
    own_id(g, call["call_id"])
    return [first["id"], await send_result(poster(g), "responses", ASK, first, tools)]


async def messages(g: Gw) -> list[str]:
    tools = tools_in("messages", "get_weather", DESCRIPTION, SCHEMA)
    forced = {"type": "tool", "name": "get_weather"}
    first = await post(
        g,
        "messages",
        {"messages": [ASK], "tools": tools, "tool_choice": forced, "max_tokens": ROOM},
    )
    uses = [block for block in first["content"] if block["type"] == "tool_use"]
    assert len(uses) == 1, first
    [use] = uses
    valid(use["input"])
    own_id(g, use["id"])
    return [first["id"], await send_result(poster(g), "messages", ASK, first, tools)]


async def test_a_forced_call_round_trips_in_every_protocol(g: Gw) -> None:
    turns = [await chat(g), await responses(g), await messages(g)]
    r = await g.http.get(f"/sessions/{g.s['id']}", headers=ADMIN)
    detail = r.json()
    # each conversation one segment, its second turn continued; the later two opened one each
    assert [seg["completion_ids"] for seg in detail["segments"]] == turns
    assert detail["prefix_breaks"] == 2
