"""No agent can break inference, and a dead engine comes back by itself: against a real
`rlgateway serve` (engine in its own process), the engine process is killed with SIGKILL while
requests are decoding. The clients get 503 with `Retry-After`, `/health` is 503 (with the reason)
while `/health/live` stays 200, and the engine is started again on the weights and version it had
(a directory update): the same greedy tokens and logprobs as before the kill, and a session that
continues its segment token for token. Weight versions the store cannot hold are refused with 400.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.limits import MAX_POLICY_VERSION
from tests.support.gateway_server import GatewayHandle, run_gateway
from tests.support.local_engine import perturbed
from tests.support.procs import live_children

pytestmark = pytest.mark.slow


def engine_pid(gw: GatewayHandle) -> int:
    """The pid of the engine process of the `rlgateway serve` listening at `gw.url`."""
    port = gw.url.rsplit(":", 1)[1].encode()
    (serve,) = [
        pid
        for pid, cmd in live_children(os.getpid())
        if b"rlgateway.cli\0serve\0" in cmd and b"\0--port\0" + port + b"\0" in cmd
    ]
    (engine,) = [pid for pid, cmd in live_children(serve) if b"engines.process_main" in cmd]
    return engine


def chat(session: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> httpx.Response:
    return httpx.post(
        f"{session['base_url']}/chat/completions",
        json={"model": "tiny", "messages": messages, **kw},
        headers={"Authorization": f"Bearer {session['api_key']}"},
        timeout=120,
    )


def stream_events(
    session: dict[str, Any],
    messages: list[dict[str, Any]],
    started: threading.Event | None = None,
    **kw: Any,
) -> list[Any]:
    """The `data:` payloads of a streamed chat request (JSON, or the string `[DONE]`); `started`
    is set once the first payload has come."""
    lines = []
    with httpx.stream(
        "POST",
        f"{session['base_url']}/chat/completions",
        json={"model": "tiny", "messages": messages, "stream": True, **kw},
        headers={"Authorization": f"Bearer {session['api_key']}"},
        timeout=120,
    ) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if started is not None:
                    started.set()
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


def poll(gw: GatewayHandle, until: Callable[[httpx.Response], bool], timeout: float) -> Any:
    """GET /health every 20 ms until `until(response)`; return that response's JSON."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{gw.url}/health", timeout=10)
        if until(r):
            return r.json()
        assert time.monotonic() < deadline, f"/health stayed {r.status_code} {r.text}"
        time.sleep(0.02)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_a_killed_engine_comes_back_by_itself_on_the_current_weights(
    tiny_model: Path, tmp_path: Path
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    update = AutoModelForCausalLM.from_config(reference.config).eval()
    update.load_state_dict(perturbed(reference, 0.05))
    update.save_pretrained(tmp_path / "v5")
    with run_gateway(tiny_model, tmp_path) as gw:
        for bad in (MAX_POLICY_VERSION + 1, 2**63, -1):
            r = gw.client.post(
                "/admin/weights", json={"path": str(tmp_path / "v5"), "version": bad}
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "version"
            assert f"[1, {MAX_POLICY_VERSION}]" in error["message"]
        r = gw.client.post("/admin/weights", json={"path": str(tmp_path / "v5"), "version": 5})
        assert r.json() == {"version": 5, "changed": True}
        r = gw.client.post("/admin/weights", json={"path": str(tmp_path / "v5"), "version": 5})
        assert r.json() == {"version": 5, "changed": False}  # the served version: a no-op
        r = gw.client.post("/admin/weights", json={"path": str(tmp_path / "v5"), "version": 4})
        assert r.status_code == 400  # older than the version served now
        assert "[6, " in r.json()["error"]["message"]

        s, probe, streamer, *loaders = gw.new_sessions(6)
        first = [user("Tell me something.")]
        greedy = {"temperature": 0, "max_tokens": 12, "logprobs": True}
        r1 = chat(s, first, **greedy)
        assert r1.status_code == 200, r1.text
        before = r1.json()["choices"][0]

        killed = engine_pid(gw)
        with ThreadPoolExecutor(len(loaders) + 1) as pool:
            long = {"max_tokens": 2000, "ignore_eos": True}
            lost = [pool.submit(chat, session, [user("Go on.")], **long) for session in loaders]
            streaming = threading.Event()
            cut = pool.submit(stream_events, streamer, [user("Go on.")], streaming, **long)
            # the stream has sent its first token (before it, a failure is a plain 503)
            assert streaming.wait(timeout=60)
            poll(gw, lambda r: r.json()["running"] == len(loaders) + 1, timeout=60)
            os.kill(killed, signal.SIGKILL)
            # the first 503 may say only that the process is gone: its exit code comes once
            # its exit is handled
            down = poll(
                gw,
                lambda r: r.status_code == 503 and "exited" in r.json()["reason"],
                timeout=30,
            )
            assert down["ok"] is False
            assert "exited with code -9" in down["reason"]
            assert down["version"] == 5
            assert httpx.get(f"{gw.url}/health/live", timeout=10).status_code == 200
            refused = chat(probe, first, max_tokens=2)  # within the restart's backoff
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert "restarting" in refused.json()["error"]["message"]
            replies = [f.result() for f in lost]
            events = cut.result()
        # the stream in flight fails as a stream: its tokens so far, an error event, [DONE]
        assert events[-1] == "[DONE]"
        assert "error" in events[-2], events[-2]
        assert "exited with code -9" in events[-2]["error"]["message"]
        assert all("error" not in e for e in events[:-2])
        (cut_turn,) = gw.session(streamer["id"])["segments"]
        assert list(gw.session(streamer["id"])["finish_reasons"].values()) == ["abort"]
        assert sum(cut_turn["loss_mask"]) >= 1
        for reply in replies:
            assert reply.status_code == 503, reply.text
            assert int(reply.headers["Retry-After"]) >= 1
            assert "exited with code -9" in reply.json()["error"]["message"]

        up = poll(gw, lambda r: r.status_code == 200, timeout=120)
        assert up["ok"] is True
        assert up["version"] == 5
        assert up["restarts"] == 1
        assert engine_pid(gw) != killed
        assert gw.client.get("/admin/version").json() == {"version": 5}

        # the weights of version 5, not the base model's: the same greedy tokens and logprobs
        again = chat(probe, first, **greedy).json()["choices"][0]
        assert again["message"]["content"] == before["message"]["content"]
        lp_before = [e["logprob"] for e in before["logprobs"]["content"]]
        lp_again = [e["logprob"] for e in again["logprobs"]["content"]]
        assert lp_again == pytest.approx(lp_before, abs=1e-5)

        # the session goes on in the same segment, token for token
        history = [*first, before["message"], user("And then?")]
        r2 = chat(s, history, temperature=0, max_tokens=8)
        assert r2.status_code == 200, r2.text
        detail = gw.session(s["id"])
        assert detail["prefix_breaks"] == 0
        (seg,) = detail["segments"]
        assert seg["completion_ids"] == [r1.json()["id"], r2.json()["id"]]
        assert {v for v in seg["versions"] if v >= 0} == {5}

        with httpx.stream(
            "POST",
            f"{probe['base_url']}/chat/completions",
            json={"model": "tiny", "messages": [user("Hi.")], "max_tokens": 8, "stream": True},
            headers={"Authorization": f"Bearer {probe['api_key']}"},
            timeout=120,
        ) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])

        metrics = gw.client.get("/metrics").text
        assert "rlgateway_engine_restarts_total 1.0" in metrics
        assert "rlgateway_engine_up 1.0" in metrics
