"""What each protocol's adapter costs over the turn core: gateway CPU per request, side by side in
one run.

    .venv/bin/python bench/bench_protocols.py [--requests 300] [--tokens 32] [--repeat 3] \
        [--model tiny|smollm2|DIR] [--tool-parser auto|hermes|...]

(SmolLM2's chat template writes tool calls in no format of its own: `--model smollm2
--tool-parser hermes`.) The gateway runs in-process (ASGI) on an engine that replays a fixed
reply at once (so only the gateway's own work is measured: no model forward; `--model` picks the
tokenizer and chat template the gateway renders and parses with), recording every turn into a
SQLite store. Each row sends the same single-turn question, with tools, through one protocol,
sequentially, and reports CPU microseconds per request (`time.process_time`: this process's CPU,
which other load on the machine does not inflate). "core" calls the turn core directly (plan,
generate, parse, commit; no HTTP, no request or response schema); the protocol rows go through
HTTP (the httpx client's own CPU included, the same for every row), so "over core" is what the
route edge and the adapter add. `--repeat` runs every row N times, interleaved, and reports
each row's median.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # for tests/support (the replay engine)

ADMIN = {"Authorization": "Bearer bench"}
QUESTION = "What is 2 plus 3?"
ADD = {"type": "object", "properties": {"a": {}, "b": {}}}


def bodies(tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    chat_tool = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    user = [{"role": "user", "content": QUESTION}]
    return {
        "chat": ("chat/completions", {"messages": user, "tools": chat_tool, "max_tokens": tokens}),
        "completions": ("completions", {"prompt": QUESTION, "max_tokens": tokens}),
        "responses": (
            "responses",
            {
                "input": QUESTION,
                "tools": [{"type": "function", "name": "add", "parameters": ADD}],
                "max_output_tokens": tokens,
            },
        ),
        "messages": (
            "messages",
            {
                "messages": user,
                "tools": [{"name": "add", "input_schema": ADD}],
                "max_tokens": tokens,
            },
        ),
    }


Send = Callable[[dict[str, Any]], Awaitable[None]]
"""One request in the given session."""
WARM = 5
"""Requests before the measured ones (tokenizer pieces, templates, connections)."""


async def cpu_per_request(sessions: list[dict[str, Any]], send: Send) -> float:
    """Each request in a session of its own (a session's later requests compare against its
    earlier segments: that is not what is measured here)."""
    for s in sessions[:WARM]:
        await send(s)
    t0 = time.process_time()
    for s in sessions[WARM:]:
        await send(s)
    return (time.process_time() - t0) / (len(sessions) - WARM) * 1e6


async def main(model: Path, tool_parser: str, requests: int, tokens: int, repeat: int) -> None:
    from engines.tiny_model import load_tokenizer
    from gateway.core.sampling import Asked
    from gateway.core.turn_types import ChatPrompt, ToolChoice, TurnSpec
    from gateway.deps import Components
    from gateway.settings import GatewaySettings
    from rlgateway.app import create_app
    from store import Store
    from tests.support.replay_engine import ReplayEngine

    tok = load_tokenizer(model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok.encode("The sum is five, " * tokens, add_special_tokens=False)[: tokens - 1]
    engine = ReplayEngine([*reply, eos], eos)
    tmp = Path(tempfile.mkdtemp(prefix="bench-protocols-"))
    store = await Store.connect(f"sqlite:///{tmp / 'store.db'}")
    app = create_app(
        GatewaySettings(admin_token="bench", tool_parser=tool_parser),
        Components(engine, store, tok, engine.eos_token_ids, model.name),  # type: ignore[arg-type]
    )
    rows: dict[str, list[float]] = {}
    async with app.router.lifespan_context(app):
        gw = app.state.gateway
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            run = (await http.post("/runs", json={"name": "b"}, headers=ADMIN)).json()["id"]

            async def sessions() -> list[dict[str, Any]]:
                made = []
                while len(made) < requests + WARM:
                    count = min(1024, requests + WARM - len(made))
                    r = await http.post(
                        f"/runs/{run}/sessions", json={"count": count}, headers=ADMIN
                    )
                    made += r.json()["sessions"]
                return made

            tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
            spec = TurnSpec(
                protocol="chat",
                id_prefix="chatcmpl-",
                prompts=[
                    ChatPrompt([{"role": "user", "content": QUESTION}], tools, ToolChoice("auto"))
                ],
                asked=Asked(max_new_tokens=tokens),
            )

            async def core(s: dict[str, Any]) -> None:
                turn = await gw.chat.core.start(spec, s["id"], run=None, respond=lambda t, c: {})
                await turn.complete()

            def via(path: str, body: dict[str, Any], stream: bool) -> Send:
                async def send(s: dict[str, Any]) -> None:
                    r = await http.post(
                        f"/sessions/{s['id']}/v1/{path}",
                        json=body | {"stream": stream},
                        headers={"Authorization": f"Bearer {s['api_key']}"},
                    )
                    assert r.status_code == 200, r.text

                return send

            senders: dict[str, Send] = {"core": core}
            for name, (path, body) in bodies(tokens).items():
                senders[name] = via(path, body, False)
                senders[f"{name} (stream)"] = via(path, body, True)
            for _ in range(repeat):
                for name, send in senders.items():
                    fresh = await sessions()
                    rows.setdefault(name, []).append(await cpu_per_request(fresh, send))
    await store.close()
    base = statistics.median(rows["core"])
    print(
        f"\n{requests} requests per row, {tokens} tokens each, median of {repeat}; "
        f"the tokenizer and chat template of {model.name}\n"
    )
    print("| path | CPU per request (us) | over core (us) |")
    print("|---|---:|---:|")
    for name, runs in rows.items():
        cpu = statistics.median(runs)
        over = "" if name == "core" else f"{cpu - base:.0f}"
        print(f"| {name} | {cpu:.0f} | {over} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", default="tiny", help="tiny (the test model), smollm2 or a directory")
    p.add_argument("--tool-parser", default="auto", help="the gateway's --tool-parser")
    a = p.parse_args()
    from rlgateway.models import resolve_model

    model = resolve_model(a.model, Path.cwd())
    asyncio.run(main(model, a.tool_parser, a.requests, a.tokens, a.repeat))
