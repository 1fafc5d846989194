"""What an agent can send that the gateway must refuse, in-process (httpx over ASGI) on the real
local engine and a real SQLite store: each case found by fuzzing a real `rlgateway serve`.

For every refused request: its status, an OpenAI-shaped body whose `param` and message name the
field (and the limit), nothing recorded, and a good request served right after. The in-process
transport re-raises any exception a route lets escape, so a case that still reached a 500 fails
here loudly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer
from tests.support.admin_client import ADMIN
from tests.support.edge import BIG, USER, Gw, edge_app, refused


@pytest.fixture
async def gw(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    async with edge_app(engine, tiny_model, tmp_path) as g:
        yield g


# -- text that is not UTF-8, numbers that are not JSON ------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages.0.content",
        ),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
        ),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], '
            '"tools": [{"type": "function", "function": {"name": "\\ud800"}}]}',
            "tools.0.function.name",
        ),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "user": "\\ud83d"}',
            "user",
        ),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            "temperature",
        ),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "metadata": {"a": [Infinity]}}',
            "metadata.a.0",
        ),
        ("completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        ("completions", '{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt.1"),
    ],
)
async def test_text_that_is_not_utf8_is_a_400_naming_the_field(
    gw: Gw, route: str, body: str, param: str
) -> None:
    r = await gw.post(route, body)
    refused(r, 400, param, "UTF-8" if "\\u" in body else "finite")
    assert await gw.recorded() == []
    await gw.still_serves()


async def test_a_surrogate_pair_is_text_and_is_served(gw: Gw) -> None:
    r = await gw.post(
        "chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    )
    assert r.status_code == 200, r.text
    assert len(await gw.recorded()) == 1


async def test_bad_text_in_admin_bodies_is_refused(gw: Gw) -> None:
    cases = [
        ("/runs", '{"name": "\\ud800"}', "name"),
        ("/runs", '{"name": "x", "config": {"lr": NaN}}', "config.lr"),
        (f"/runs/{gw.run['id']}/sessions", '{"metadata": {"\\ud800": 1}}', "metadata"),
        (f"/runs/{gw.run['id']}/sessions", '{"group_id": "\\udc00"}', "group_id"),
        (f"/sessions/{gw.s['id']}/reward", '{"reward": 1, "key": "\\ud800"}', "key"),
    ]
    for url, body, param in cases:
        r = await gw.http.post(
            url, content=body.encode(), headers={**ADMIN, "content-type": "application/json"}
        )
        refused(r, 400, param)
    runs = (await gw.http.get("/runs", headers=ADMIN)).json()["runs"]
    assert [x["id"] for x in runs] == [gw.run["id"]]
    r = await gw.http.get(f"/runs/{gw.run['id']}/sessions", headers=ADMIN)
    assert r.json()["total"] == 1
    assert (await gw.http.get(f"/sessions/{gw.s['id']}", headers=ADMIN)).json()["rewards"] == []
    await gw.still_serves()


# -- values that would reach the engine unbounded ------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "param", "limit"),
    [
        ("top_k", 2**63, "top_k", "2147483647"),
        ("top_k", 2**31, "top_k", "2147483647"),
        ("seed", BIG, "seed", "9223372036854775807"),
        ("seed", -1, "seed", "0"),
        ("stop_token_ids", [1, 2**63], "stop_token_ids.1", "2147483647"),
        ("stop_token_ids", [-1], "stop_token_ids.0", "0"),
        ("max_tokens", 2**31, "max_tokens", "2147483647"),
        ("max_completion_tokens", BIG, "max_completion_tokens", "2147483647"),
        ("min_tokens", 2**40, "min_tokens", "2147483647"),
        ("n", 17, "n", "16"),
        ("top_logprobs", 21, "top_logprobs", "20"),
        ("temperature", 1e308, "temperature", "2"),
    ],
)
async def test_sampling_values_out_of_range_are_400_naming_the_limit(
    gw: Gw, field: str, value: Any, param: str, limit: str
) -> None:
    refused(await gw.chat(**{field: value}), 400, param, limit)
    assert await gw.recorded() == []
    await gw.still_serves()


async def test_stop_token_ids_outside_the_vocabulary_are_a_400(gw: Gw, tiny_model: Path) -> None:
    vocab = len(load_tokenizer(tiny_model))
    r = await gw.chat(stop_token_ids=[0, vocab])
    refused(r, 400, "stop_token_ids", str(vocab), "vocabulary")
    r = await gw.post("completions", {"prompt": "x", "stop_token_ids": [vocab + 7]})
    refused(r, 400, "stop_token_ids", "vocabulary")
    assert await gw.recorded() == []
    assert (await gw.chat(stop_token_ids=[vocab - 1], top_k=2**31 - 1)).status_code == 200
    await gw.still_serves()


async def test_completions_make_at_most_16_generations_a_request(gw: Gw) -> None:
    for prompt, n in ((["a"] * 5, 4), (["a"] * 17, 1), ([[65]] * 2, 9)):
        r = await gw.post("completions", {"prompt": prompt, "n": n, "max_tokens": 1})
        refused(r, 400, "prompt", f"{len(prompt)} prompts x n={n}", "at most 16")
    assert await gw.recorded() == []
    r = await gw.post("completions", {"prompt": ["a"] * 4, "n": 4, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16
    await gw.still_serves()


# -- strict types where OpenAI's API is strict ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("stream", 1),
        ("logprobs", "true"),
        ("top_logprobs", False),
        ("top_logprobs", 2.0),
        ("n", "2"),
        ("temperature", "1"),
        ("temperature", True),
        ("ignore_eos", "no"),
        ("seed", 1.5),
    ],
)
async def test_lax_types_are_refused(gw: Gw, field: str, value: Any) -> None:
    refused(await gw.chat(**{field: value}), 400, field)
    assert await gw.recorded() == []
    await gw.still_serves()


async def test_completion_logprobs_is_a_count_not_a_boolean(gw: Gw) -> None:
    r = await gw.post("completions", {"prompt": "x", "logprobs": True, "max_tokens": 1})
    refused(r, 400, "logprobs")
    r = await gw.post("completions", {"prompt": "x", "echo": "false", "max_tokens": 1})
    refused(r, 400, "echo")
    assert await gw.recorded() == []
    r = await gw.post("completions", {"prompt": "x", "logprobs": 2, "max_tokens": 1})
    assert r.status_code == 200, r.text


# -- a tool result answers a tool call -----------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*USER, {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "messages.1"),
        (
            [
                *USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_2", "content": "5"},
            ],
            "messages.2",
        ),
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                *USER,
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
            ],
            "messages.2",
        ),
        (
            [
                *USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "5"},
            ],
            "messages.2",
        ),
    ],
)
async def test_a_tool_message_without_its_call_is_a_400(
    gw: Gw, messages: list[dict[str, Any]], param: str
) -> None:
    r = await gw.post("chat/completions", {"messages": messages, "tools": [TOOL]})
    refused(r, 400, f"{param}.tool_call_id", "tool call")
    assert await gw.recorded() == []
    answered = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "6"},
    ]
    r = await gw.post("chat/completions", {"messages": answered, "tools": [TOOL], "max_tokens": 2})
    assert r.status_code == 200, r.text


# -- what is not served is said, never quietly ignored -------------------------------------------

REFUSING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System messages are only allowed at the beginning of the conversation') }}"
    "{%- endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
"""Mistral's and Gemma's way: a system message after the first is an error of the template's."""


async def test_a_template_that_refuses_the_messages_is_a_400_in_its_words(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Codex's layout (instructions, then a developer message) on a template that allows one
    system message: a 400 with the template's words, recorded nowhere; not a 500 SDKs retry."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    async with edge_app(engine, model, tmp_path) as g:
        words = "System messages are only allowed at the beginning"
        late = [*USER, {"role": "system", "content": "be brief"}]
        refused(await g.post("chat/completions", {"messages": late}), 400, "messages", words)
        codex = {
            "instructions": "You are a coding agent.",
            "input": [
                {"role": "developer", "content": "Sandbox: read-only."},
                {"role": "user", "content": "hello"},
            ],
        }
        refused(await g.post("responses", codex), 400, "messages", words)
        assert await g.recorded() == []
        await g.still_serves()


FAILING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{%- for c in m.tool_calls or [] %}{{ c['function']['arguments'] + 1 }}{%- endfor %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
"""A template that fails on what a request holds (a TypeError inside it, as Granite's on a
null content), whether a call's arguments are given as an object or as JSON text."""


async def test_a_template_that_fails_on_the_messages_is_a_400_naming_the_error(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(FAILING_TEMPLATE)
    async with edge_app(engine, model, tmp_path) as g:
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]
        r = await g.post("chat/completions", {"messages": history})
        refused(r, 400, "messages", "TypeError")
        assert await g.recorded() == []
        await g.still_serves()


BAD_SCHEMA = {"type": "strin"}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            "response_format",
        ),
        ("chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("completions", {"response_format": {"type": "regex"}}, "response_format"),
        ("completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
        ("responses", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ("responses", {"text": {"format": {"type": "json_schema", "schema": []}}}, "text.format"),
        ("responses", {"conversation": "conv_123"}, "conversation"),
    ],
)
async def test_what_is_not_served_is_a_400_naming_it(
    gw: Gw, route: str, body: dict[str, Any], param: str
) -> None:
    """A format with no schema or one the grammar compiler refuses, vLLM's guided_* extensions
    and conversations (not kept here) are refused, never answered as if they had been honoured
    (the reply would be trained); the same request with a schema that compiles is served."""
    ask = {
        "chat/completions": {"messages": USER, "max_tokens": 2},
        "completions": {"prompt": "hello", "max_tokens": 2},
        "responses": {"input": "hello", "max_output_tokens": 2},
    }[route]
    refused(await gw.post(route, {**ask, **body}), 400, param, "")
    assert await gw.recorded() == []
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    text = (
        {"response_format": fmt}
        if route != "responses"
        else {"text": {"format": {"type": "json_object"}}}
    )
    r = await gw.post(route, {**ask, **text})
    assert r.status_code == 200, r.text


async def test_structured_outputs_on_messages_refuse_in_anthropics_shape(gw: Gw) -> None:
    bad = {"type": "json_schema", "schema": BAD_SCHEMA}
    ask = {"max_tokens": 2, "messages": USER}
    for param, extra in (
        ("output_format", {"output_format": bad}),
        ("output_config.format", {"output_config": {"format": bad}}),
    ):
        r = await gw.post("messages", {**ask, **extra})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(f"{param}.schema: the JSON schema cannot"), body
    assert await gw.recorded() == []
    good = {"type": "json_schema", "schema": {"type": "object"}}
    for extra in ({"output_format": good}, {"output_config": {"format": good, "effort": "high"}}):
        r = await gw.post("messages", {**ask, **extra})
        assert r.status_code == 200, r.text


# -- query integers, rewards, and JSON that can be written back ----------------------------------


@pytest.mark.parametrize(
    ("route", "param"),
    [
        ("sessions", "offset"),
        ("sessions", "min_version"),
        ("sessions", "max_version"),
        ("sessions", "min_prefix_breaks"),
        ("sessions", "max_prefix_breaks"),
        ("export", "max_version"),
        ("export", "min_prefix_breaks"),
        ("metrics", "after"),
    ],
)
async def test_query_integers_past_the_stores_columns_are_422(
    gw: Gw, route: str, param: str
) -> None:
    url = f"/runs/{gw.run['id']}/{route}"
    for value in (BIG, 2**31):
        r = await gw.http.get(url, params={param: value}, headers=ADMIN)
        refused(r, 422, param, "2147483647")
    r = await gw.http.get(url, params={param: 2**31 - 1}, headers=ADMIN)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity"])
async def test_reward_filters_are_finite(gw: Gw, value: str) -> None:
    for route in ("sessions", "export"):
        r = await gw.http.get(
            f"/runs/{gw.run['id']}/{route}", params={"min_reward": value}, headers=ADMIN
        )
        refused(r, 422, "min_reward", "finite")


def strict_json(line: str) -> Any:
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(line, parse_constant=no_constants)


async def test_rewards_are_bounded_and_the_export_is_strict_json(gw: Gw) -> None:
    url = f"/sessions/{gw.s['id']}/reward"
    for body, status, needle in (
        ({"reward": 1e308}, 422, "1000000"),
        ({"reward": -1e6 - 1}, 422, "-1000000"),
        ({"reward": True}, 422, "number"),
        ({"reward": "1"}, 422, "number"),
        ('{"reward": Infinity}', 400, "finite"),
        ('{"reward": NaN}', 400, "finite"),
    ):
        if isinstance(body, str):
            headers = {**gw.key, "content-type": "application/json"}
            r = await gw.http.post(url, content=body.encode(), headers=headers)
        else:
            r = await gw.http.post(url, json=body, headers=gw.key)
        refused(r, status, "reward", needle)
    r = await gw.http.put(url, json={"reward": 1e308}, headers=ADMIN)
    refused(r, 422, "reward", "1000000")
    assert (await gw.http.get(f"/sessions/{gw.s['id']}", headers=ADMIN)).json()["rewards"] == []
    with pytest.raises(ValueError, match="1e"):
        await gw.store.add_reward(gw.s["id"], 1e308)
    await gw.still_serves()
    for _ in range(2):  # the largest rewards, twice: the episode's total is finite
        r = await gw.http.post(url, json={"reward": 1e6}, headers=gw.key)
        assert r.status_code == 200, r.text
    r = await gw.http.get(f"/runs/{gw.run['id']}/export", headers=ADMIN)
    assert r.status_code == 200
    (line,) = [strict_json(x) for x in r.text.splitlines()]
    assert line["reward"] == 2e6
    r = await gw.http.get(f"/runs/{gw.run['id']}/sessions", headers=ADMIN)
    assert strict_json(r.text)["sessions"][0]["reward"] == 2e6
