"""A model whose chat template writes tool calls in no format the gateway knows, through a real
`rlgateway serve`: the parser is never guessed. The startup log warns, `/health` and `/v1/models`
say `unknown`, a request that asks for tool calls is a 400 naming `--tool-parser` (OpenAI's shape
on chat and Responses, Anthropic's on Messages) that commits nothing, while `tool_choice: none`
and requests without tools are served. Naming the parser (`--tool-parser hermes`) serves them,
and the same endpoints say which parser reads the calls."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway_server import GatewayHandle, run_gateway
from tests.support.openai_clients import user

pytestmark = pytest.mark.slow

PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template with no tool-call format at all."""
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def plain_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(PLAIN)
    return model


@pytest.fixture(scope="module")
def plain_gw(
    plain_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHandle]:
    with run_gateway(plain_model, tmp_path_factory.mktemp("gw-plain")) as gw:
        yield gw


def post(gw: GatewayHandle, session: dict[str, Any], path: str, body: dict[str, Any]) -> Any:
    base = session["base_url"].removesuffix("/v1")
    headers = {"authorization": f"Bearer {session['api_key']}", "x-api-key": session["api_key"]}
    return httpx.post(f"{base}/v1/{path}", json=body, headers=headers, timeout=60)


def test_the_unknown_format_is_said_at_startup_and_on_health_and_models(
    plain_gw: GatewayHandle,
) -> None:
    assert "writes tool calls in no format the gateway knows" in plain_gw.log_tail()
    health = httpx.get(f"{plain_gw.url}/health", timeout=10).json()
    assert health["parsers"] == {"tool_calls": "unknown", "reasoning": "none"}
    [model] = plain_gw.client.get("/v1/models").json()["data"]
    assert model["parsers"]["tool_calls"] == "unknown"


def test_asking_for_tool_calls_is_a_400_naming_the_setting_and_commits_nothing(
    plain_gw: GatewayHandle,
) -> None:
    s = plain_gw.new_session()
    asks = [
        ("chat/completions", {"messages": [user("x")], "tools": TOOLS, "max_tokens": 4}),
        ("responses", {"input": "x", "tools": [{"type": "function", "name": "f"}]}),
    ]
    for path, body in asks:
        r = post(plain_gw, s, path, {"model": "tiny", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "tools"
        assert "--tool-parser" in error["message"]
    anthropic_tools = [{"name": "f", "input_schema": {"type": "object"}}]
    r = post(
        plain_gw,
        s,
        "messages",
        {"model": "tiny", "max_tokens": 4, "messages": [user("x")], "tools": anthropic_tools},
    )
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "--tool-parser" in r.json()["error"]["message"]
    assert plain_gw.session(s["id"])["segments"] == []
    # nothing asked of a parser: served
    for body in (
        {"messages": [user("x")], "tools": TOOLS, "tool_choice": "none", "max_tokens": 4},
        {"messages": [user("x")], "max_tokens": 4},
    ):
        assert post(plain_gw, s, "chat/completions", {"model": "tiny", **body}).status_code == 200


def test_naming_the_parser_serves_tool_calls(
    plain_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with run_gateway(
        plain_model, tmp_path_factory.mktemp("gw-named"), extra_args=("--tool-parser", "hermes")
    ) as gw:
        s = gw.new_session()
        body = {"model": "tiny", "messages": [user("x")], "tools": TOOLS, "max_tokens": 4}
        assert post(gw, s, "chat/completions", body).status_code == 200
        health = httpx.get(f"{gw.url}/health", timeout=10).json()
        assert health["parsers"]["tool_calls"] == "hermes"
