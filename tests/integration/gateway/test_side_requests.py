"""Side requests (`store.run_config`, `side_requests`): what Claude Code sends beside its agent's
work (a title, a one-token quota check) and a header-marked request are answered and recorded as
any turn, marked with the rule that matched them (in the detail and the `x-rlgateway-side`
header), and left out of what the trainer takes and what the export writes; a side turn inside
the agent's own segment stays as context only. The same requests in a run without rules are all
trained (the control). In-process on the real local engine and a real SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.local import LocalEngine
from store.types import SessionFilter, Trajectory
from tests.support.admin_client import ADMIN
from tests.support.edge import Gw, edge_app
from trainer.algorithms.config import AlgorithmConfig
from trainer.sequences import build_sequences

RULES = [
    {"name": "title", "system": r"(?i)\btitle\b"},
    {"name": "quota", "max_tokens_below": 2},
    {"name": "marked", "header": "X-Side-Request"},
]
AGENT = "You are an interactive CLI agent that helps with software engineering."
TITLE = "Summarize this coding conversation in under 50 characters. Reply with the title only."
SIDE = "x-rlgateway-side"


@pytest.fixture(params=["rules", "no rules"])
async def g(
    request: pytest.FixtureRequest,
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> AsyncIterator[Gw]:
    config = {"side_requests": RULES} if request.param == "rules" else {}
    async with edge_app(engine, tiny_model, tmp_path, config) as g:
        yield g


def ruled(g: Gw) -> bool:
    return bool(g.run["config"].get("side_requests"))


async def post(g: Gw, route: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    r = await g.http.post(
        f"/sessions/{g.s['id']}/v1/{route}", json=body, headers={**g.key, **headers}
    )
    assert r.status_code == 200, r.text
    return r


async def trained(g: Gw) -> Trajectory:
    """The session as the trainer takes it, once ended with a reward."""
    sid = g.s["id"]
    for path, body in (("reward", {"reward": 1.0}), ("end", {})):
        r = await g.http.post(f"/sessions/{sid}/{path}", json=body, headers=g.key)
        assert r.is_success, r.text
    [t] = await g.store.list_trainable(g.run["id"])
    return t


async def detail(g: Gw) -> dict[str, Any]:
    r = await g.http.get(f"/sessions/{g.s['id']}", headers=ADMIN)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_claude_codes_side_requests_are_recorded_and_never_trained(g: Gw) -> None:
    ask = [{"role": "user", "content": "fix the failing test"}]
    main = await post(g, "messages", {"max_tokens": 6, "system": AGENT, "messages": ask})
    title = await post(g, "messages", {"max_tokens": 8, "system": TITLE, "messages": ask})
    quota = await post(
        g, "messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}
    )
    marked = await post(
        g, "chat/completions", {"messages": ask, "max_tokens": 4}, **{"x-side-request": "1"}
    )
    named = await post(
        g, "responses", {"instructions": TITLE, "input": "x", "max_output_tokens": 4}
    )
    ids = [r.json()["id"] for r in (main, title, quota, marked, named)]
    said = [r.headers.get(SIDE) for r in (main, title, quota, marked, named)]
    rules = [None, "title", "quota", "marked", "title"] if ruled(g) else [None] * 5
    assert said == rules

    # the detail shows every turn, each marked with its rule
    segments = (await detail(g))["segments"]
    assert [s["completion_ids"] for s in segments] == [[i] for i in ids]
    assert [s["turn_side"] for s in segments] == [[r] for r in rules]
    # a side request opens a segment of its own, which is no prefix break of the agent's
    assert (await detail(g))["prefix_breaks"] == (0 if ruled(g) else 4)

    t = await trained(g)
    kept = [s.completion_ids for s in t.segments]
    assert kept == ([[ids[0]]] if ruled(g) else [[i] for i in ids])
    assert t.side_turns == (4 if ruled(g) else 0)
    assert build_sequences([t], AlgorithmConfig()).side_turns == t.side_turns
    # the export leaves them out as the trainer does, unless asked for them
    default = [d async for d, _ in g.store.export_sessions(g.run["id"], SessionFilter())]
    assert [s.completion_ids for s in default[0].segments] == kept
    everything = SessionFilter(include_side=True)
    whole = [d async for d, _ in g.store.export_sessions(g.run["id"], everything)]
    assert [s.completion_ids for s in whole[0].segments] == [[i] for i in ids]


async def test_a_replayed_side_request_says_so_again(g: Gw) -> None:
    """A retry under the same `Idempotency-Key` replays the first answer, its header too."""
    body = {"max_tokens": 8, "system": TITLE, "messages": [{"role": "user", "content": "x"}]}
    key = {"Idempotency-Key": "title-1"}
    first = await post(g, "messages", body, **key)
    again = await post(g, "messages", body, **key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert again.headers.get(SIDE) == first.headers.get(SIDE) == ("title" if ruled(g) else None)


async def test_a_side_turn_inside_the_agents_segment_stays_context_only(g: Gw) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    ids = []
    for turn, headers in enumerate(({}, {"x-side-request": "1"}, {})):
        r = await post(
            g, "chat/completions", {"messages": history, "max_tokens": 4, "seed": turn}, **headers
        )
        ids.append(r.json()["id"])
        reply = r.json()["choices"][0]["message"]["content"]
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    [whole] = (await detail(g))["segments"]
    assert whole["completion_ids"] == ids  # one segment: the side turn continued the history
    t = await trained(g)
    [seg] = t.segments
    assert seg.tokens == whole["tokens"]
    side_span = whole["turn_spans"][1]
    if ruled(g):
        assert seg.completion_ids == [ids[0], ids[2]]
        assert set(seg.loss_mask[side_span[0] : side_span[1]]) == {0}  # context, not trained
        assert sum(seg.loss_mask) == sum(whole["loss_mask"]) - (side_span[1] - side_span[0])
        assert set(t.returns) == {ids[0], ids[2]}
    else:
        assert seg.completion_ids == ids
        assert seg.loss_mask == whole["loss_mask"]


async def test_a_bad_rule_is_a_400_naming_it_and_the_run_serves_on(g: Gw) -> None:
    """A run config with a rule that cannot act (a pattern that is not a regular expression, a
    rule with no condition) is refused as a whole, naming the key; nothing is made, and the
    session already running is served as before."""
    before = (await g.http.get("/runs", headers=ADMIN)).json()
    for rule in ({"name": "t", "system": "(unclosed"}, {"name": "t"}):
        r = await g.http.post(
            "/runs", json={"name": "bad", "config": {"side_requests": [rule]}}, headers=ADMIN
        )
        assert r.status_code == 400, r.text
        assert "side_requests" in r.json()["error"]["message"], r.text
    assert (await g.http.get("/runs", headers=ADMIN)).json() == before
    await g.still_serves()
