"""The parser settings act: the same greedy reply of the thinking scripted model, read by the
gateway (in-process over ASGI, one local engine) under different `tool_parser` and
`reasoning_parser` settings, gives different messages, while the recorded tokens are the same."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine, LocalEngineConfig
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.components import tiny_components
from tests.support.scripted_model import CALL, THOUGHT, TOOLS

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer admin-token"}


@pytest.fixture(scope="module")
def thinking_dir() -> Path:
    from tests.support.scripted_model import scripted_model_dir

    return scripted_model_dir(thinking=True)


@pytest.fixture(scope="module")
def engine(thinking_dir: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine.load(LocalEngineConfig(model=str(thinking_dir)))
    yield engine
    asyncio.run(engine.close())


async def reply(
    engine: LocalEngine, model_dir: Path, tmp_path: Path, **settings: str
) -> tuple[dict[str, Any], list[int]]:
    """The message of one greedy tool-using turn under `settings`, and its recorded tokens."""
    store = await Store.connect(f"sqlite:///{tmp_path / 'gw.db'}")
    app = create_app(
        GatewaySettings(admin_token="admin-token", **settings),
        tiny_components(engine, store, model_dir),
    )
    body = {
        "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
        "tools": TOOLS,
        "temperature": 0,
    }
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            run = await http.post("/runs", json={"name": "t"}, headers=ADMIN)
            made = await http.post(
                f"/runs/{run.json()['id']}/sessions", json={"count": 1}, headers=ADMIN
            )
            s = made.json()["sessions"][0]
            auth = {"Authorization": f"Bearer {s['api_key']}"}
            r = await http.post(f"/sessions/{s['id']}/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            detail = await http.get(f"/sessions/{s['id']}", headers=ADMIN)
    await store.close()
    message: dict[str, Any] = r.json()["choices"][0]["message"]
    tokens: list[int] = detail.json()["segments"][0]["tokens"]
    return message, tokens


async def test_reasoning_parser_think_splits_the_reasoning_off_and_none_keeps_it(
    engine: LocalEngine, thinking_dir: Path, tmp_path: Path
) -> None:
    think, think_tokens = await reply(
        engine, thinking_dir, tmp_path / "a", reasoning_parser="think"
    )
    plain, plain_tokens = await reply(engine, thinking_dir, tmp_path / "b", reasoning_parser="none")
    assert think_tokens == plain_tokens
    assert think["reasoning_content"] == THOUGHT
    assert [c["function"]["name"] for c in think["tool_calls"]] == [CALL["name"]]
    # without a reasoning parser the thought is text: the content before the call
    assert "reasoning_content" not in plain
    assert plain["content"] == f"<think>\n{THOUGHT}\n</think>"
    assert [c["function"]["name"] for c in plain["tool_calls"]] == [CALL["name"]]


async def test_tool_parser_setting_reads_the_call_in_that_format_only(
    engine: LocalEngine, thinking_dir: Path, tmp_path: Path
) -> None:
    hermes, _ = await reply(
        engine, thinking_dir, tmp_path / "a", reasoning_parser="think", tool_parser="hermes"
    )
    mistral, _ = await reply(
        engine, thinking_dir, tmp_path / "b", reasoning_parser="think", tool_parser="mistral"
    )
    assert [c["function"]["name"] for c in hermes["tool_calls"]] == ["add"]
    assert "tool_calls" not in mistral
    assert mistral["content"].startswith("<tool_call>")
