"""What an agent can send that the gateway must refuse, in-process (httpx over ASGI) on the real
local engine and a real SQLite store: each case found by fuzzing a real `rlgateway serve`.

For every refused request: its status, an OpenAI-shaped body whose `param` and message name the
field (and the limit), nothing recorded, and a good request served right after. The in-process
transport re-raises any exception a route lets escape, so a case that still reached a 500 fails
here loudly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer
from gateway.settings import GatewaySettings
from rlgateway.app import create_app
from store import Store
from tests.integration.admin_client import ADMIN, bearer, engine  # noqa: F401
from tests.support.components import tiny_components

USER = [{"role": "user", "content": "hello"}]
BODY_LIMIT = 64 * 1024
BIG = 2**64


class Gw:
    """The app, its store, and one run with one session."""

    def __init__(self, http: httpx.AsyncClient, store: Store) -> None:
        self.http = http
        self.store = store
        self.run: dict[str, Any] = {}
        self.s: dict[str, Any] = {}

    @property
    def key(self) -> dict[str, str]:
        return bearer(self.s["api_key"])

    async def post(self, route: str, body: Any) -> httpx.Response:
        """POST `body` (a dict, or raw JSON text) to the session's `/v1/{route}`."""
        url = f"/sessions/{self.s['id']}/v1/{route}"
        if isinstance(body, str):
            headers = {**self.key, "content-type": "application/json"}
            return await self.http.post(url, content=body.encode(), headers=headers)
        return await self.http.post(url, json=body, headers=self.key)

    async def chat(self, **body: Any) -> httpx.Response:
        return await self.post("chat/completions", {"messages": USER, "max_tokens": 2, **body})

    async def recorded(self) -> list[list[str]]:
        """The completion ids of the session's segments."""
        r = await self.http.get(f"/sessions/{self.s['id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
        return [seg["completion_ids"] for seg in r.json()["segments"]]

    async def still_serves(self) -> None:
        """A good request is answered and recorded, after whatever came before."""
        before = await self.recorded()
        r = await self.chat(seed=0)
        assert r.status_code == 200, r.text
        assert await self.recorded() == [*before, [r.json()["id"]]]


@pytest.fixture
async def gw(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gw]:  # noqa: F811
    store = await Store.connect(f"sqlite:///{tmp_path / 'bad.db'}")
    components = tiny_components(engine, store, tiny_model)
    app = create_app(
        GatewaySettings(admin_token="admin-token", max_body_bytes=BODY_LIMIT), components
    )
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=60
            ) as http:
                g = Gw(http, store)
                r = await http.post("/runs", json={"name": "bad", "config": {}}, headers=ADMIN)
                g.run = r.json()
                r = await http.post(f"/runs/{g.run['id']}/sessions", json={}, headers=ADMIN)
                g.s = r.json()["sessions"][0]
                yield g
    finally:
        await store.close()


def refused(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for needle in (param or "", *needles):
        assert needle in err["message"], err["message"]


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
async def test_sampling_values_out_of_range_are_422_naming_the_limit(
    gw: Gw, field: str, value: Any, param: str, limit: str
) -> None:
    refused(await gw.chat(**{field: value}), 422, param, limit)
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
    refused(await gw.chat(**{field: value}), 422, field)
    assert await gw.recorded() == []
    await gw.still_serves()


async def test_completion_logprobs_is_a_count_not_a_boolean(gw: Gw) -> None:
    r = await gw.post("completions", {"prompt": "x", "logprobs": True, "max_tokens": 1})
    refused(r, 422, "logprobs")
    r = await gw.post("completions", {"prompt": "x", "echo": "false", "max_tokens": 1})
    refused(r, 422, "echo")
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


async def test_an_unexpected_error_is_an_openai_shaped_500(
    engine: LocalEngine,  # noqa: F811
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
    from tests.integration.gateway_server import run_gateway

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
                ("POST", chat, json.dumps({"messages": USER, "top_k": 2**63}), 422),
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
