"""A gateway on remote engines is a light process: `rlgateway serve --engine sglang` imports
neither torch nor transformers, from its start through turns of every protocol.

The real `serve` runs with `PYTHONPROFILEIMPORTTIME=1` (Python logs every module it imports) in
front of the fake SGLang server (its own process; it imports torch, the gateway must not), and
serves a run's session through the openai SDK (chat with tools, a forced call, logprobs,
streaming, a JSON schema, completions, responses) and the anthropic SDK, then its trajectory
with each token's text; the log names no module of torch or transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.fake_sglang import run_fake_sglang
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow

HEAVY = re.compile(r"\|\s*(torch|transformers)(\.\S+)?\s*$", re.MULTILINE)
"""An import-time line of a module of torch or transformers."""

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def test_a_gateway_on_remote_engines_imports_neither_torch_nor_transformers(
    tiny_model: Path, tmp_path: Path
) -> None:
    with (
        run_fake_sglang(tiny_model) as server,
        run_gateway(
            tiny_model,
            tmp_path,
            extra_args=["--engine", "sglang", "--engine-url", server.url],
            extra_env={"PYTHONPROFILEIMPORTTIME": "1"},
        ) as gw,
    ):
        run_id = gw.create_run("light", {"batch_size": 2, "group_size": 2})
        s = gw.new_session(run_id=run_id)
        agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"])
        history = [{"role": "user", "content": "add 2 and 3"}]
        chat = agent.chat.completions.create(
            model="tiny", messages=history, tools=[TOOL], max_tokens=8, logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        assert chat.choices[0].logprobs is not None
        forced = agent.chat.completions.create(
            model="tiny", messages=history, tools=[TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, seed=0,
        )  # fmt: skip
        assert forced.choices[0].finish_reason == "tool_calls", forced
        [call] = forced.choices[0].message.tool_calls or []
        assert call.function.name == "add"  # type: ignore[union-attr]
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        shaped = agent.chat.completions.create(
            model="tiny", messages=history, max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )  # fmt: skip
        assert shaped.choices[0].message.content is not None
        stream = agent.chat.completions.create(
            model="tiny", messages=history, max_tokens=8, stream=True
        )
        assert [c for c in stream]
        agent.completions.create(model="tiny", prompt="2 + 3 =", max_tokens=4)
        agent.responses.create(model="tiny", input="add 2 and 3", max_output_tokens=8)
        claude = anthropic.Anthropic(
            base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"]
        )
        claude.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "add 2 and 3"}]
        )
        detail = gw.client.get(f"/sessions/{s['id']}", params={"texts": True}).json()
        assert detail["segments"][0]["texts"]
        log = gw.log_path.read_text()
    assert "import time:" in log, "the gateway ran with PYTHONPROFILEIMPORTTIME"
    assert "gateway.core.tokenizer" in log
    heavy = sorted({m.group(1) for m in HEAVY.finditer(log)})
    assert not heavy, (
        f"the gateway imported {heavy}: "
        + "\n".join(line for line in log.splitlines() if HEAVY.search(line))[:3000]
    )
