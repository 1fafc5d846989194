"""The request edge, in-process (httpx over ASGI) on the real local engine and a real SQLite
store: bodies over the limit (declared or chunked), each route's errors in its protocol's envelope
at every layer, an unexpected error as a 500 in the same shape, 405s naming the allowed methods,
and a real server answering the fuzzed cases on one connection."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

from engines.local import LocalEngine
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.support.admin_client import ADMIN
from tests.support.components import tiny_components
from tests.support.edge import BIG, BODY_LIMIT, USER, Gw, edge_app, refused


@pytest.fixture
async def gw(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:
    async with edge_app(engine, tiny_model, tmp_path) as g:
        yield g


# -- the request edge ----------------------------------------------------------------------------


async def test_a_chunked_body_over_the_limit_is_413(gw: Gw) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'"}]}'

    url = f"/sessions/{gw.s['id']}/v1/chat/completions"
    r = await gw.http.post(
        url, content=chunks(), headers={**gw.key, "content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    refused(r, 413, None, f"larger than {BODY_LIMIT} bytes")
    assert r.json()["error"]["code"] == "payload_too_large"
    assert await gw.recorded() == []
    await gw.still_serves()


@pytest.mark.parametrize("prefix", ["", "/sessions/{id}"])
async def test_each_route_answers_errors_in_its_protocols_envelope(gw: Gw, prefix: str) -> None:
    """The envelope is the route's, whichever layer answers: the body limit (before routing), the
    router (a method the path does not serve), validation, the handler; at `/v1` and in a
    session's path alike."""
    base = prefix.format(id=gw.s["id"]) + "/v1"
    big = {"content-type": "application/json", "content-length": str(BODY_LIMIT + 1)}
    ok = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path, anthropic in (("/messages", True), ("/chat/completions", False)):
        answers = [
            await gw.http.post(
                base + path, content=b"x" * (BODY_LIMIT + 1), headers={**gw.key, **big}
            ),
            await gw.http.get(base + path, headers=gw.key),
            await gw.http.post(base + path, json={"messages": 3}, headers=gw.key),
            await gw.http.post(base + path, json=ok, headers={"authorization": "Bearer rlg-no"}),
        ]
        assert [r.status_code for r in answers] == [413, 405, 400, 401]
        for r in answers:
            body = r.json()
            if anthropic:
                assert body.get("type") == "error", (r.status_code, body)
                assert set(body["error"]) == {"type", "message"}, body
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
    await gw.still_serves()


@pytest.mark.parametrize("route", ["messages", "responses"])
async def test_any_left_out_tool_name_makes_a_valid_header(gw: Gw, route: str) -> None:
    """Names of tools the model cannot call are named in a header, each percent-encoded where it
    is not printable ASCII (or holds a comma): a name with CR/LF injects no header, a non-Latin-1
    one fails nothing, and the answer the turn was recorded for is the one sent."""
    names = ["网页搜索", "web_search\r\nx-evil: 1", "a,b"]
    if route == "messages":
        tools = [{"type": "web_search_20250305", "name": n} for n in names]
        body = {"max_tokens": 2, "messages": USER, "tools": tools}
    else:
        tools = [{"type": "custom", "name": n} for n in names]
        body = {"max_output_tokens": 2, "input": "hello", "tools": tools}
    r = await gw.post(route, body)
    assert r.status_code == 200, r.text
    assert "x-evil" not in r.headers
    header = r.headers["x-rlgateway-tools-left-out"]
    assert header == "%E7%BD%91%E9%A1%B5%E6%90%9C%E7%B4%A2, web_search%0D%0Ax-evil:%201, a%2Cb"
    assert [unquote(n) for n in header.split(", ")] == names
    assert await gw.recorded() == [[r.json()["id"]]]


async def test_an_unexpected_error_is_an_openai_shaped_500(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = await Store.connect(f"sqlite:///{tmp_path / 'boom.db'}")
    components = tiny_components(engine, store, tiny_model)
    app = create_app(GatewaySettings(admin_token="admin-token"), components)

    async def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(store, "list_runs", broken)
    try:
        async with app.router.lifespan_context(app):
            # as a server does: the app's exception is answered, then raised for the log
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                r = await http.get("/runs", headers=ADMIN)
                assert r.status_code == 500
                assert r.json() == {
                    "error": {
                        "message": "internal error: RuntimeError",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                assert (await http.get("/engines", headers=ADMIN)).status_code == 200
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/runs", "GET, POST"),
        ("PATCH", "/sessions/sess_x/reward", "POST, PUT"),
        ("GET", "/runs/run_x/pause", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
        ("POST", "/ui", "GET"),
    ],
)
async def test_405_names_the_allowed_methods(gw: Gw, method: str, path: str, allow: str) -> None:
    r = await gw.http.request(method, path, headers=ADMIN)
    refused(r, 405, None, method, path, allow)
    assert r.headers["allow"] == allow


@pytest.mark.slow
def test_a_real_server_answers_the_fuzzed_cases_on_one_connection(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What the fuzzer met on `rlgateway serve`: plain-text 500s and reset connections. Here
    every case is an OpenAI-shaped 4xx on one keep-alive connection, and it still serves."""
    from tests.support.gateway_server import run_gateway

    with run_gateway(tiny_model, tmp_path) as real:
        run_id = real.create_run("fuzzed")
        s = real.new_session(run_id=run_id)
        key = {"Authorization": f"Bearer {s['api_key']}", "content-type": "application/json"}
        chat = f"/sessions/{s['id']}/v1/chat/completions"
        with httpx.Client(base_url=real.url, timeout=60) as http:
            cases = [
                ("POST", chat, '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
                (
                    "POST",
                    chat,
                    '{"messages": [{"role": "user", "content": "x"}], "top_k": 1e400}',
                    400,
                ),
                ("POST", chat, json.dumps({"messages": USER, "top_k": 2**63}), 400),
                ("POST", f"/sessions/{s['id']}/reward", '{"reward": 1e308}', 422),
                ("GET", f"/runs/{run_id}/sessions?offset={BIG}", None, 422),
                ("GET", f"/runs/{run_id}/export?max_version={BIG}", None, 422),
                ("GET", f"/runs/{run_id}/metrics?after={BIG}", None, 422),
            ]
            for method, url, body, status in cases:
                r = http.request(
                    method,
                    url,
                    content=body.encode() if body else None,
                    headers={**key, **real.admin_headers} if method == "GET" else key,
                )
                assert r.status_code == status, (url, r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = http.post(chat, json={"messages": USER, "max_tokens": 2}, headers=key)
            assert r.status_code == 200, r.text
        assert [seg["completion_ids"] for seg in real.session(s["id"])["segments"]] == [
            [r.json()["id"]]
        ]
