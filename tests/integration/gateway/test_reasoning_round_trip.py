"""A reasoning block and a tool call round-trip through chat completions, the Responses API and
Messages on each reasoning family's own chat template (`tests/support/templates/`, as its model
card publishes it), with the parsers the template picks: GLM-4.5 and MiniMax-M2 (`<think>`, the
latter opened by its generation prompt), DeepSeek-V3.1 in thinking mode (opened by the prompt, the
template's `thinking` switch passed as `chat_template_kwargs`) and gpt-oss (harmony's analysis
channel, then a commentary message to `functions.get_weather`). Llama-4's pythonic call (no
reasoning) the same way: its template is too long for the local engine's tiny model.

The engine replays the reply as the family's model writes it (`ReplayEngine`: these are the
gateway's own readings, which must be exactly known; the random tiny model writes no reasoning),
tokenized by the tiny model's vocabulary under the family's template. The reasoning comes back as
the protocol's own (`reasoning_content`, a `reasoning` item, a `thinking` block), apart from the
call; the client sends both back with the tool's result, and the conversation stays one segment
(its exact tokens, the reasoning in them), the template rendering only what follows the turn."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.tiny_model import load_tokenizer
from tests.support.admin_client import ADMIN
from tests.support.edge import Gw, edge_app
from tests.support.paths import REPO_ROOT
from tests.support.replay_engine import ReplayEngine
from tests.support.round_trip import Post, send_result, tools_in
from tests.support.tool_formats import deepseek_v31, glm45, harmony, minimax_m2, pythonic

TEMPLATES = REPO_ROOT / "tests" / "support" / "templates"
THOUGHT = "I should look the weather up."
ARGS = {"city": "Oslo", "days": 2}
CALL = [("get_weather", ARGS)]
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # family: (the reasoning parser its template picks, the reply, chat_template_kwargs)
    "glm45": ("think", f"\n<think>{THOUGHT}</think>\n{glm45(CALL)}", {}),
    "minimax_m2": ("think", f"{THOUGHT}\n</think>\n\n{minimax_m2(CALL)}", {}),
    "deepseek_v31": ("think", f"{THOUGHT}</think>{deepseek_v31(CALL)}", {"thinking": True}),
    "gpt_oss": (
        "openai_gptoss",
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant{harmony(CALL)}",
        {},
    ),
    # no reasoning; here because its template's instructions outgrow the tiny model's context,
    # which only the local engine holds a prompt to (test_family_round_trip.py)
    "llama4_pythonic": ("none", pythonic(CALL), {}),
}
PARSER = {"gpt_oss": "openai"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
DESCRIPTION = "The weather in a city."
ASK = {"role": "user", "content": "Weather in Oslo?"}


@pytest.fixture(params=list(FAMILIES))
async def g(request: pytest.FixtureRequest, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    family = request.param
    model_dir = tmp_path / family
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, model_dir / name)
    shutil.copy(TEMPLATES / f"{family}.jinja", model_dir / "chat_template.jinja")
    tok = load_tokenizer(model_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    reply = FAMILIES[family][1]
    engine = ReplayEngine([*tok.encode(reply, add_special_tokens=False), eos], eos)
    parser = PARSER.get(family, family)
    async with edge_app(engine, model_dir, tmp_path, tool_parser=parser) as g:  # type: ignore[arg-type]
        g.family = family
        yield g


def kwargs(g: Gw) -> dict[str, Any]:
    template_kwargs = FAMILIES[g.family][2]
    return {"chat_template_kwargs": template_kwargs} if template_kwargs else {}


async def post(g: Gw, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await g.post(route, {**body, **kwargs(g)})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def poster(g: Gw) -> Post:
    return functools.partial(post, g)


def reasons(g: Gw) -> bool:
    return FAMILIES[g.family][0] != "none"


async def chat(g: Gw) -> list[str]:
    tools = tools_in("chat/completions", "get_weather", DESCRIPTION, SCHEMA)
    first = await post(g, "chat/completions", {"messages": [ASK], "tools": tools})
    message = first["choices"][0]["message"]
    assert message.get("reasoning_content") == (THOUGHT if reasons(g) else None)
    assert not message.get("content")
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == CALL[0]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    return [first["id"], await send_result(poster(g), "chat/completions", ASK, first, tools)]


async def responses(g: Gw) -> list[str]:
    tools = tools_in("responses", "get_weather", DESCRIPTION, SCHEMA)
    first = await post(g, "responses", {"input": [ASK], "tools": tools, "store": False})
    kinds = ["reasoning", "function_call"] if reasons(g) else ["function_call"]
    assert [item["type"] for item in first["output"]] == kinds
    *thought, call = first["output"]
    assert [t["content"][0]["text"] for t in thought] == ([THOUGHT] if reasons(g) else [])
    assert (call["name"], json.loads(call["arguments"])) == CALL[0]
    return [first["id"], await send_result(poster(g), "responses", ASK, first, tools)]


async def messages(g: Gw) -> list[str]:
    tools = tools_in("messages", "get_weather", DESCRIPTION, SCHEMA)
    first = await post(g, "messages", {"messages": [ASK], "tools": tools, "max_tokens": 400})
    kinds = ["thinking", "tool_use"] if reasons(g) else ["tool_use"]
    assert [block["type"] for block in first["content"]] == kinds
    *thought, use = first["content"]
    assert [t["thinking"] for t in thought] == ([THOUGHT] if reasons(g) else [])
    assert (use["name"], use["input"]) == CALL[0]
    assert first["stop_reason"] == "tool_use"
    return [first["id"], await send_result(poster(g), "messages", ASK, first, tools)]


async def test_reasoning_and_a_call_round_trip_in_every_protocol(g: Gw) -> None:
    r = await g.http.get("/health")
    assert r.json()["parsers"]["reasoning"] == FAMILIES[g.family][0], r.json()
    turns = [await chat(g), await responses(g), await messages(g)]
    r = await g.http.get(f"/sessions/{g.s['id']}", headers=ADMIN)
    detail = r.json()
    # each conversation one segment, its second turn continued; the later two opened one each
    assert [seg["completion_ids"] for seg in detail["segments"]] == turns
    assert detail["prefix_breaks"] == 2
    tok = load_tokenizer(g.model_dir)
    for segment in detail["segments"]:  # the reasoning stays in the recorded tokens, verbatim
        recorded = tok.decode(segment["tokens"], skip_special_tokens=False)
        assert FAMILIES[g.family][1] + "<|im_end|>" in recorded, recorded


async def test_streamed_the_reasoning_comes_apart_and_no_markup_is_shown(g: Gw) -> None:
    """Chat streamed: the reasoning arrives as `reasoning_content` deltas, the call as a tool
    call, and no content delta ever holds the family's markup."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    if g.family == "gpt_oss":
        tools[0]["function"]["description"] = DESCRIPTION
    body = {"messages": [ASK], "tools": tools, "stream": True}
    r = await g.post("chat/completions", {**body, **kwargs(g)})
    assert r.status_code == 200, r.text
    chunks = [
        json.loads(line[len("data: ") :])
        for line in r.text.splitlines()
        if line.startswith("data: {")
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas).strip()
    assert thought == (THOUGHT if reasons(g) else "")
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["get_weather"]
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(arguments) == ARGS
