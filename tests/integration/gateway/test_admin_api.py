"""The admin API in-process on the real local engine and store: runs and their control, the
session browser's filters, one session token by token, rewards set by hand, the JSONL export,
training time series and versions, engines, Prometheus `/metrics`, the docs and the page's
assets."""

from __future__ import annotations

import json
from pathlib import Path

from engines.local import LocalEngine
from gateway.export import SCHEMA
from tests.support.admin_client import ADMIN, USER, app_client, bearer, parse_prometheus


async def test_runs_lifecycle(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'a.db'}") as c:
        run = await c.run({"batch_size": 4}, name="first")
        assert run["status"] == "active"
        assert run["api_key"].startswith("rlr-")
        # the run's own key creates and uses sessions
        r = await c.http.post(
            f"/runs/{run['id']}/sessions", json={"count": 2}, headers=bearer(run["api_key"])
        )
        assert r.status_code == 201
        s = r.json()["sessions"][0]
        assert s["base_url"].endswith(f"/sessions/{s['id']}/v1")
        assert s["api_key"].startswith("rlg-")
        r = await c.http.post(
            f"/sessions/{s['id']}/v1/chat/completions",
            json={"messages": USER, "max_tokens": 3},
            headers=bearer(run["api_key"]),
        )
        assert r.status_code == 200
        await c.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1}, headers=ADMIN)
        listed = (await c.http.get("/runs", headers=ADMIN)).json()["runs"]
        mine = next(x for x in listed if x["id"] == run["id"])
        assert (mine["sessions"], mine["active_sessions"], mine["rewarded_sessions"]) == (2, 2, 1)
        assert "api_key" not in mine
        # pause, resume, stop; a stopped run stays stopped and takes no sessions
        for action, status in (("pause", "paused"), ("resume", "active"), ("stop", "stopped")):
            r = await c.http.post(f"/runs/{run['id']}/{action}", headers=ADMIN)
            assert r.json()["status"] == status
            assert (await c.store.get_run(run["id"])).status == status
        r = await c.http.post(f"/runs/{run['id']}/resume", headers=ADMIN)
        assert r.status_code == 409
        assert "stopped" in r.json()["error"]["message"]
        r = await c.http.post(f"/runs/{run['id']}/sessions", json={"count": 1}, headers=ADMIN)
        assert r.status_code == 409
        # delete: the run, its sessions and their keys are gone
        r = await c.http.delete(f"/runs/{run['id']}", headers=ADMIN)
        assert r.json() == {"id": run["id"], "deleted": True, "sessions": 2}
        assert (await c.http.get(f"/runs/{run['id']}", headers=ADMIN)).status_code == 404
        assert (await c.http.get(f"/sessions/{s['id']}", headers=ADMIN)).status_code == 404
        r = await c.http.get(f"/sessions/{s['id']}", headers=bearer(s["api_key"]))
        assert r.status_code == 401
        assert (await c.http.delete(f"/runs/{run['id']}", headers=ADMIN)).status_code == 404


async def test_a_run_config_is_the_trainers_and_a_bad_one_says_which_key(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'a.db'}") as c:
        for config, message in (
            ({"eta": -1}, "config.eta: Input should be greater than or equal to 0 (got -1)"),
            ({"optim": {"lrr": 1}}, "config.optim.lrr: unknown key (known here: lr,"),
            ({"algo": {"eps_low": 2}}, "config: algo.eps_low: Input should be less than 1"),
            ({"batch_size": 3, "group_size": 2}, "must be a multiple of group_size"),
            ({"group_size": 1}, "with group_size 1 every advantage is 0"),
            ({"algorithm": "dapo"}, "set max_tokens"),
            ({"backend": "archon:t2"}, "archon: tensor parallel is not implemented yet"),
            ({"backend": "fsdp:d2e4"}, "expert size 4 must divide data x context = 2"),
            ({"backend": {"aux_loss_coef": 0.1}}, "config.backend.aux_loss_coef: unknown key"),
            (
                {"backend": {"type": "archon", "coef": 0.1}},
                "config.backend.coef: unknown key (known here: type, allocation, attention, aux",
            ),
        ):
            r = await c.http.post("/runs", json={"name": "x", "config": config}, headers=ADMIN)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert message in error["message"]
            assert error["param"] == "config"
        assert (await c.http.get("/runs", headers=ADMIN)).json()["runs"] == []
        config = {"algorithm": "dapo", "max_tokens": 1024, "optim": {"lr": 1e-4}}
        run = await c.run(config)
        assert run["config"] == config


async def test_session_browser_filters_and_pages(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'b.db'}") as c:
        run = await c.run()
        sessions = [(await c.sessions(run["id"]))[0] for _ in range(5)]  # one created_at each
        for i, s in enumerate(sessions):
            first = await c.chat(s)
            if i == 4:  # an edited history: a prefix break
                edited = [{"role": "user", "content": "HELLO"}, first["choices"][0]["message"]]
                await c.chat(s, [*edited, {"role": "user", "content": "again"}])
            if i < 4:
                await c.http.post(
                    f"/sessions/{s['id']}/reward", json={"reward": float(i)}, headers=ADMIN
                )
            if i % 2 == 0:
                await c.http.post(f"/sessions/{s['id']}/end", headers=ADMIN)
        base = f"/runs/{run['id']}/sessions"

        async def ids(query: str) -> list[str]:
            r = await c.http.get(f"{base}?{query}", headers=ADMIN)
            assert r.status_code == 200, r.text
            return [x["id"] for x in r.json()["sessions"]]

        newest_first = [s["id"] for s in reversed(sessions)]
        assert await ids("") == newest_first
        assert set(await ids("status=ended")) == {sessions[i]["id"] for i in (0, 2, 4)}
        assert set(await ids("min_reward=1&max_reward=2")) == {sessions[i]["id"] for i in (1, 2)}
        assert await ids("rewarded=false") == [sessions[4]["id"]]
        assert await ids("min_prefix_breaks=1") == [sessions[4]["id"]]
        assert await ids("min_version=0&max_version=0") == newest_first
        assert await ids("min_version=1") == []
        page = (await c.http.get(f"{base}?limit=2&offset=2", headers=ADMIN)).json()
        assert [x["id"] for x in page["sessions"]] == newest_first[2:4]
        assert page["total"] == 5
        assert page["next_offset"] == 4
        assert page["sessions"][0]["turns"] == 1
        assert page["sessions"][0]["reward"] == 2.0
        last = (await c.http.get(f"{base}?limit=2&offset=4", headers=ADMIN)).json()
        assert last["next_offset"] is None
        r = await c.http.get(f"{base}?min_reward=3&max_reward=1", headers=ADMIN)
        assert r.status_code == 400
        assert "swap" in r.json()["error"]["message"]
        r = await c.http.get(f"{base}?status=sleeping", headers=ADMIN)
        assert r.status_code == 422
        r = await c.http.get(f"{base}?limit=0", headers=ADMIN)
        assert r.status_code == 422
        assert (await c.http.get("/runs/run_nope/sessions", headers=ADMIN)).status_code == 404


async def test_one_session_texts_manual_reward_and_export(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'c.db'}") as c:
        run = await c.run({"discount": 0.5})
        s, other = await c.sessions(run["id"], 2, group_id="g1", metadata={"task": "t"})
        first = await c.chat(s)
        follow = [*USER, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        second = await c.chat(s, follow)
        await c.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
        await c.http.post(f"/sessions/{s['id']}/end", headers=ADMIN)
        await c.chat(other)

        d = (await c.http.get(f"/sessions/{s['id']}?texts=true", headers=ADMIN)).json()
        [seg] = d["segments"]
        assert len(seg["texts"]) == len(seg["tokens"])
        assert "".join(seg["texts"]).startswith("<|im_start|>user\nhello<|im_end|>")
        assert (
            "texts"
            not in (await c.http.get(f"/sessions/{s['id']}", headers=ADMIN)).json()["segments"][0]
        )

        # a reward set by hand replaces the final reward; a turn's reward is set on its own
        r = await c.http.put(f"/sessions/{s['id']}/reward", json={"reward": -2.0}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert [x["reward"] for x in r.json()["rewards"]] == [-2.0]
        r = await c.http.put(
            f"/sessions/{s['id']}/reward",
            json={"reward": 4.0, "completion_id": first["id"]},
            headers=ADMIN,
        )
        assert r.json()["returns"] == {first["id"]: 4.0 + 0.5 * -2.0, second["id"]: -2.0}
        r = await c.http.put(
            f"/sessions/{s['id']}/reward", json={"reward": 1.0, "completion_id": "x"}, headers=ADMIN
        )
        assert r.status_code == 404
        r = await c.http.put(f"/sessions/{s['id']}/reward", json={"reward": "nan"}, headers=ADMIN)
        assert r.status_code == 422

        # the export: one line per session, schema v1, equal-length arrays
        r = await c.http.get(f"/runs/{run['id']}/export", headers=ADMIN)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.text.splitlines()]
        # oldest first, ties (one creation call) by id
        assert [x["session_id"] for x in lines] == sorted([s["id"], other["id"]])
        by_id = {x["session_id"]: x for x in lines}
        line = by_id[s["id"]]
        assert line["schema"] == SCHEMA
        assert line["reward"] == 2.0
        assert line["metadata"] == {"task": "t"}
        assert line["group_id"] == "g1"
        [eseg] = line["segments"]
        n = len(eseg["tokens"])
        assert len(eseg["loss_mask"]) == len(eseg["logprobs"]) == len(eseg["versions"]) == n
        assert eseg["tokens"] == seg["tokens"]
        assert eseg["loss_mask"] == seg["loss_mask"]
        assert (
            eseg["messages"][-1]
            == second["choices"][0]["message"]
            | {"content": second["choices"][0]["message"]["content"]}
            or eseg["messages"][-1]["role"] == "assistant"
        )
        assert eseg["completion_ids"] == [first["id"], second["id"]]
        assert eseg["turn_returns"] == [3.0, -2.0]
        assert by_id[other["id"]]["reward"] is None
        r = await c.http.get(f"/runs/{run['id']}/export?status=ended&rewarded=true", headers=ADMIN)
        assert [json.loads(x)["session_id"] for x in r.text.splitlines()] == [s["id"]]


async def test_training_series_versions_engines_and_prometheus(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'd.db'}") as c:
        run = await c.run({"eta": 0, "batch_size": 1, "group_size": 1, "algorithm": "ppo"})
        empty = (await c.http.get(f"/runs/{run['id']}/metrics", headers=ADMIN)).json()
        assert empty["steps"] == []
        assert empty["series"] == {}
        for step in (1, 2, 3):
            await c.store.record_step(
                run["id"],
                step,
                version=step,
                metrics={
                    "reward_mean": 0.1 * step,
                    "loss": 1.0 / step,
                    "staleness_mean": 0.5,
                    "staleness_max": 1,
                    "tokens_per_s": 100.0 * step,
                    "step_seconds": 2.0,
                    "flag": True,
                },
                checkpoint=f"/ckpt/step-{step:06d}",
            )
        m = (await c.http.get(f"/runs/{run['id']}/metrics", headers=ADMIN)).json()
        assert m["steps"] == [1, 2, 3]
        assert m["series"]["loss"] == [1.0, 0.5, 1.0 / 3]
        assert "flag" not in m["series"]
        m = (await c.http.get(f"/runs/{run['id']}/metrics?after=2", headers=ADMIN)).json()
        assert m["steps"] == [3]
        assert m["series"]["tokens_per_s"] == [300.0]
        v = (await c.http.get(f"/runs/{run['id']}/versions", headers=ADMIN)).json()
        assert v["engine_version"] == engine.version()
        assert [(x["version"], x["checkpoint"]) for x in v["versions"]] == [
            (i, f"/ckpt/step-{i:06d}") for i in (1, 2, 3)
        ]
        e = (await c.http.get("/engines", headers=ADMIN)).json()["engines"][0]
        assert e["ok"] is True
        assert e["version"] == engine.version()
        assert e["load"] >= 0

        # traffic for the counters: tokens, a prefix break, a reward, a 429
        (s,) = await c.sessions(run["id"])
        first = await c.chat(s)
        await c.chat(s, [{"role": "user", "content": "x"}, first["choices"][0]["message"]])
        await c.http.post(f"/sessions/{s['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
        r = await c.http.post(f"/runs/{run['id']}/sessions", json={"count": 5}, headers=ADMIN)
        assert r.status_code == 429
        await c.http.post(f"/runs/{run['id']}/pause", headers=ADMIN)
        done = await c.run()
        await c.store.record_step(done["id"], 1, version=1, metrics={"step_seconds": 1.0})
        await c.http.post(f"/runs/{done['id']}/stop", headers=ADMIN)

        r = await c.http.get("/metrics", headers=ADMIN)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        samples = parse_prometheus(r.text)
        d = await c.store.session_detail(s["id"])
        sampled = sum(sum(seg.loss_mask) for seg in d.segments)
        context = sum(len(seg.tokens) for seg in d.segments) - sampled
        assert samples['rlgateway_tokens_captured_total{kind="sampled"}'] == sampled
        assert samples['rlgateway_tokens_captured_total{kind="prompt"}'] == context
        assert samples["rlgateway_completions_recorded_total"] == 2
        assert samples["rlgateway_prefix_breaks_total"] == 1
        assert samples['rlgateway_rewards_total{source="api"}'] == 1
        assert samples["rlgateway_admission_rejections_total"] == 1
        assert samples["rlgateway_engine_version"] == engine.version()
        assert samples["rlgateway_engine_paused"] == 0
        rid = run["id"]
        assert samples[f'rlgateway_run_paused{{run="{rid}"}}'] == 1
        assert samples[f'rlgateway_trainer_step{{run="{rid}"}}'] == 3
        assert samples[f'rlgateway_trainer_step_seconds{{run="{rid}"}}'] == 2.0
        assert samples[f'rlgateway_trainer_staleness_max{{run="{rid}"}}'] == 1
        chat_route = "/sessions/{session_id}/v1/chat/completions"
        assert (
            samples[
                f'rlgateway_http_requests_total{{method="POST",route="{chat_route}",status="200"}}'
            ]
            == 2
        )
        assert (
            samples[
                'rlgateway_http_requests_total{method="POST",route="/runs/{run_id}/sessions",'
                'status="429"}'
            ]
            == 1
        )
        key = f'rlgateway_http_request_duration_seconds_count{{method="POST",route="{chat_route}"}}'
        assert samples[key] == 2
        assert not any(s["id"] in k for k in samples)  # ids never become labels
        assert not any(done["id"] in k for k in samples)  # stopped runs drop out


async def test_docs_and_page_assets(engine: LocalEngine, tiny_model: Path, tmp_path: Path) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'e.db'}") as c:
        docs = await c.http.get("/docs")
        assert docs.status_code == 200
        assert 'href="/openapi.json"' in docs.text
        paths = (await c.http.get("/openapi.json")).json()["paths"]
        for p in ("/runs", "/runs/{run_id}/export", "/runs/{run_id}/metrics", "/metrics"):
            assert p in paths
        page = await c.http.get("/ui")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        for src in ("/ui/app.js", "/ui/charts.js", "/ui/tokens.js", "/ui/style.css"):
            assert src in page.text
            r = await c.http.get(src)
            assert r.status_code == 200
            assert len(r.content) > 500
        assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from a CDN
        assert (await c.http.get("/ui/secrets.txt")).status_code == 404
        assert (await c.http.get("/ui/..%2fapp.py")).status_code == 404
