"""Auth and isolation, the whole matrix: every route x {admin, run A's key, run B's key, session
key of A, session key of B, no key}, on resources of run A. A key of run B never reads or writes
anything of run A (404 where a resource of A is named, 403 on admin routes), and what the
denied calls tried to write is not in the store. Runs on SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engines.local import LocalEngine
from store.types import SessionFilter
from tests.support.admin_client import ADMIN, USER, App, app_client, bearer  # noqa: F401

PRINCIPALS = ("none", "run_b", "session_b", "session_a", "run_a", "admin")
CHAT = {"messages": USER, "max_tokens": 2, "seed": 0}
RESPONSE = {"input": "ab", "max_output_tokens": 2}
MESSAGE = {"messages": USER, "max_tokens": 2}


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    allowed: frozenset[str]
    """Principals that succeed (every other gets `denied[p]` or the default)."""
    body: Any = None
    ok: int = 200
    """The success status; for the admin, `admin_ok` when the admin's answer differs."""
    admin_ok: int | None = None
    foreign: int = 404
    """What run B's keys get (404: A's resource is not revealed; 403 on admin routes)."""
    own_denied: int = 403


ADMIN_ONLY = frozenset({"admin"})
RUN = frozenset({"admin", "run_a"})
SESSION = frozenset({"admin", "run_a", "session_a"})


def cases(a: str, sa: str, rid: str) -> list[Case]:
    """Every route of the API, in an order where destructive calls come last."""
    return [
        Case("GET", "/runs", ADMIN_ONLY, foreign=403),
        Case("POST", "/runs", ADMIN_ONLY, {"name": "x", "config": {}}, ok=201, foreign=403),
        Case("GET", "/engines", ADMIN_ONLY, foreign=403),
        Case("GET", "/admin/version", ADMIN_ONLY, foreign=403),
        Case(
            "POST",
            "/admin/weights",
            ADMIN_ONLY,
            {"path": "/nonexistent"},
            admin_ok=400,
            foreign=403,
        ),
        # the weight group: the in-process engine takes none (409, publish from disk)
        Case("GET", "/admin/weights/group", ADMIN_ONLY, admin_ok=409, foreign=403),
        Case(
            "POST",
            "/admin/weights/group",
            ADMIN_ONLY,
            {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2},
            admin_ok=409,
            foreign=403,
        ),
        Case(
            "POST",
            "/admin/weights/broadcast",
            ADMIN_ONLY,
            {"buckets": [[{"name": "w", "dtype": "float32", "shape": [2]}]]},
            admin_ok=409,
            foreign=403,
        ),
        Case("GET", "/metrics", ADMIN_ONLY, foreign=403),
        Case("GET", f"/runs/{a}", RUN),
        Case("GET", f"/runs/{a}/sessions", RUN),
        Case("POST", f"/runs/{a}/sessions", RUN, {"count": 1}, ok=201),
        Case("GET", f"/runs/{a}/metrics", RUN),
        Case("GET", f"/runs/{a}/versions", RUN),
        Case("GET", f"/runs/{a}/export", RUN),
        Case("GET", f"/sessions/{sa}", SESSION),
        Case("GET", f"/sessions/{sa}/v1/models", SESSION),
        Case("GET", f"/sessions/{sa}/v1/models/tiny", SESSION),
        Case("POST", f"/sessions/{sa}/v1/chat/completions", SESSION, CHAT),
        Case("POST", f"/sessions/{sa}/v1/completions", SESSION, {"prompt": "ab", "max_tokens": 2}),
        Case("POST", f"/sessions/{sa}/v1/responses", SESSION, RESPONSE),
        Case("GET", f"/sessions/{sa}/v1/responses/{rid}", SESSION),
        Case("POST", f"/sessions/{sa}/v1/messages", SESSION, MESSAGE),
        Case("POST", f"/sessions/{sa}/v1/messages/count_tokens", SESSION, MESSAGE),
        Case("POST", f"/sessions/{sa}/reward", SESSION, {"reward": 1.0}),
        Case("PUT", f"/sessions/{sa}/reward", ADMIN_ONLY, {"reward": 0.5}, foreign=403),
        Case("POST", f"/sessions/{sa}/end", SESSION),
        Case("POST", f"/runs/{a}/pause", ADMIN_ONLY),
        Case("POST", f"/runs/{a}/resume", ADMIN_ONLY),
        Case("POST", f"/runs/{a}/key", ADMIN_ONLY),
        Case("POST", f"/runs/{a}/stop", ADMIN_ONLY),
        Case("DELETE", f"/runs/{a}", ADMIN_ONLY),
    ]


def expected(case: Case, who: str) -> int:
    if who == "none":
        return 401
    if who in case.allowed:
        return case.admin_ok if who == "admin" and case.admin_ok else case.ok
    if who in ("run_b", "session_b"):
        return case.foreign
    return case.own_denied


def route_key(method: str, path: str, a: str, sa: str, rid: str) -> tuple[str, str]:
    path = path.replace(a, "{run_id}").replace(sa, "{session_id}")
    path = path.replace("/v1/models/tiny", "/v1/models/{model_id}")
    return method, path.replace(rid, "{response_id}")


async def test_every_route_for_every_kind_of_key(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,
) -> None:
    async with app_client(engine, tiny_model, store_url) as c:
        run_a, run_b = await c.run(name="A"), await c.run(name="B")
        (sess_a,) = await c.sessions(run_a["id"])
        (sess_b,) = await c.sessions(run_b["id"])
        await c.chat(sess_b)
        keys = {
            "admin": ADMIN,
            "run_a": bearer(run_a["api_key"]),
            "run_b": bearer(run_b["api_key"]),
            "session_a": bearer(sess_a["api_key"]),
            "session_b": bearer(sess_b["api_key"]),
            "none": {},
        }
        a, sa = run_a["id"], sess_a["id"]
        kept = await c.http.post(f"/sessions/{sa}/v1/responses", json=RESPONSE, headers=ADMIN)
        rid = kept.json()["id"]
        table = cases(a, sa, rid)

        # the table covers every route the app serves (the page and docs aside)
        served = {(m.upper(), path) for path, ops in c.app.openapi()["paths"].items() for m in ops}
        covered = {route_key(k.method, k.path, a, sa, rid) for k in table}
        plain = {
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("GET", "/v1/models/{model_id}"),
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/{response_id}"),
            ("POST", "/v1/messages"),
            ("POST", "/v1/messages/count_tokens"),
        }
        assert served - plain == covered, sorted(served ^ covered)

        # the plain /v1 routes: the admin (unrecorded) and session keys (into their own
        # session) may call them; a run key must name a session
        plain_bodies = {
            "/v1/chat/completions": CHAT,
            "/v1/responses": RESPONSE,
            "/v1/messages": MESSAGE,
            "/v1/messages/count_tokens": MESSAGE,
        }
        for path, body in plain_bodies.items():
            for who, want in (("none", 401), ("run_a", 403), ("run_b", 403), ("admin", 200)):
                r = await c.http.post(path, json=body, headers=keys[who])
                assert r.status_code == want, (path, who, r.text)
        for who, want in (("none", 401), ("run_a", 403), ("session_b", 404), ("admin", 200)):
            r = await c.http.get(f"/v1/responses/{rid}", headers=keys[who])
            assert r.status_code == want, (who, r.text)
        for who, want in (("none", 401), ("run_a", 403), ("session_b", 200), ("admin", 200)):
            r = await c.http.get("/v1/models/tiny", headers=keys[who])
            assert r.status_code == want, (who, r.text)
        before = len(
            (await c.http.get(f"/sessions/{sess_b['id']}", headers=ADMIN)).json()["segments"]
        )
        r = await c.http.post("/v1/chat/completions", json=CHAT, headers=keys["session_b"])
        assert r.status_code == 200
        after = (await c.http.get(f"/sessions/{sess_b['id']}", headers=ADMIN)).json()
        assert len(after["segments"]) == before + 1  # recorded into B's own session

        for case in table:
            for who in PRINCIPALS:
                r = await c.http.request(case.method, case.path, json=case.body, headers=keys[who])
                if r.status_code >= 400 and "/v1/messages" in case.path:  # Anthropic's shape
                    assert r.json()["type"] == "error"
                    assert set(r.json()["error"]) == {"type", "message"}
                elif r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                want = expected(case, who)
                assert r.status_code == want, (case.method, case.path, who, r.text)
                if case.path.endswith("/key") and who == "admin":  # A's key was replaced
                    assert (
                        await c.http.get(f"/runs/{a}", headers=keys["run_a"])
                    ).status_code == 401
                    keys["run_a"] = bearer(r.json()["api_key"])
                # nothing of A is revealed to B: the message of a denial names no session data
                if who in ("run_b", "session_b"):
                    assert "api_key" not in r.text
                    assert "segments" not in r.text

        # run B's data is untouched by all of this, and A is gone (deleted by the admin last)
        b = (await c.http.get(f"/runs/{run_b['id']}/sessions", headers=keys["run_b"])).json()
        assert [s["id"] for s in b["sessions"]] == [sess_b["id"]]
        assert after["rewards"] == []
        assert (await c.http.get(f"/runs/{a}", headers=ADMIN)).status_code == 404
        # A's keys died with it; B's still work
        assert (await c.http.get(f"/sessions/{sa}", headers=keys["session_a"])).status_code == 401
        assert (await c.http.get(f"/runs/{a}", headers=keys["run_a"])).status_code == 401
        assert (await c.http.get(f"/runs/{run_b['id']}", headers=keys["run_b"])).status_code == 200


async def test_denied_writes_leave_no_trace(
    engine: LocalEngine,
    tiny_model: Path,
    store_url: str,
) -> None:
    async with app_client(engine, tiny_model, store_url) as c:
        run_a, run_b = await c.run(name="A"), await c.run(name="B")
        (sess_a,) = await c.sessions(run_a["id"])
        first = await c.chat(sess_a)
        for key in (run_b["api_key"], "rlr-forged", "rlg-forged"):
            h = bearer(key)
            await c.http.post(f"/sessions/{sess_a['id']}/reward", json={"reward": 9.0}, headers=h)
            await c.http.post(f"/sessions/{sess_a['id']}/end", headers=h)
            await c.http.post(f"/runs/{run_a['id']}/sessions", json={"count": 3}, headers=h)
            await c.http.post(f"/runs/{run_a['id']}/pause", headers=h)
            await c.http.delete(f"/runs/{run_a['id']}", headers=h)
            await c.http.post(f"/sessions/{sess_a['id']}/v1/chat/completions", json=CHAT, headers=h)
        d = await c.store.session_detail(sess_a["id"])
        assert d.rewards == []
        assert d.info.status.value == "active"
        assert [s.completion_ids for s in d.segments] == [[first["id"]]]
        run = await c.store.get_run(run_a["id"])
        assert run.status == "active"
        page, total = await c.store.list_sessions(run_a["id"], SessionFilter())
        assert total == 1
        assert page[0].info.id == sess_a["id"]


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
async def test_keys_work_in_either_header_and_a_replaced_run_key_stops(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
    header: str,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'k.db'}") as c:
        run = await c.run()

        def h(key: str) -> dict[str, str]:
            return bearer(key) if header == "authorization" else {"x-api-key": key}

        r = await c.http.post(
            f"/runs/{run['id']}/sessions", json={"count": 2}, headers=h(run["api_key"])
        )
        assert r.status_code == 201
        new = (await c.http.post(f"/runs/{run['id']}/key", headers=ADMIN)).json()["api_key"]
        assert new != run["api_key"]
        r = await c.http.get(f"/runs/{run['id']}", headers=h(run["api_key"]))
        assert r.status_code == 401
        assert (await c.http.get(f"/runs/{run['id']}", headers=h(new))).status_code == 200
