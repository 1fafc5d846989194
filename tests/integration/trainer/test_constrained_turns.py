"""The sampling contract's constrained turns (`store.run_config`, "Constrained turns") through the
gateway and the trainer: replies held to a JSON schema are recorded with the masked
distribution's logprobs (above the trainer's own, which has no mask), and the trainer trains them
on-policy with the proximal logprob in their place: ratio 1 and behaviour weight 1 on data just
sampled, decoupled or not, where training them as recorded would weigh them by Z < 1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.trainer_harness import MAX_TOKENS, harness, train_config
from trainer.backends.registry import build_backend
from trainer.loop import Trainer
from trainer.publish import LocalPublisher
from trainer.sequences import build_sequences

pytestmark = pytest.mark.slow

LETTERS = {
    "type": "json_schema",
    "json_schema": {
        "name": "letters",
        "schema": {
            "type": "object",
            "properties": {"w": {"type": "string", "maxLength": 8}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
}


NOTE_TOOL = {
    "type": "function",
    "function": {"name": "note", "parameters": LETTERS["json_schema"]["schema"]},  # type: ignore[index]
}
HELD = {
    "json_schema": {"response_format": LETTERS},
    "forced_tool_call": {"tools": [NOTE_TOOL], "tool_choice": "required"},
}
"""A reply held to a JSON schema, and a tool call forced and held to its tool's schema."""


@pytest.mark.parametrize("held", list(HELD))
async def test_constrained_turns_record_the_masked_logprobs(
    tiny_model: Path, tmp_path: Path, held: str
) -> None:
    async with harness(tiny_model, tmp_path) as h:
        h.extra = HELD[held] | {"max_tokens": 5 * MAX_TOKENS}
        run_id = await h.run({"batch_size": 8})
        for g in range(2):
            sessions = await h.group(run_id, 4, f"g{g}")
            await asyncio.gather(*(h.episode(s) for s in sessions))
        trajs = await h.store.claim(run_id, limit=8, owner="t", lease_seconds=60)
        cfg = train_config(run_id, tmp_path)
        built = build_sequences(trajs, cfg.algorithm_config())
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        logps = backend.forward_logprobs(built.sequences, 1.0)
    gaps = []
    for seq, logp in zip(built.sequences, logps, strict=True):
        assert seq.constrained is not None
        assert [c for c, m in zip(seq.constrained, seq.loss_mask, strict=True) if m] == [
            True
        ] * seq.num_loss_tokens
        gaps += [
            b - t for b, t, m in zip(seq.behav_logprobs, logp, seq.loss_mask, strict=True) if m
        ]
    # log mu - log pi = -log Z >= 0: trained as recorded, the weight pi / mu would be Z < 1
    assert min(gaps) >= -1e-4
    assert max(gaps) > 0.5
    for t in trajs:
        for seg in t.segments:
            if held == "json_schema":
                assert json.loads(seg.turn_sampling[0]["json_schema"])["required"] == ["w"]
            else:
                assert '"required": ["w"]' in seg.turn_sampling[0]["grammar"]


@pytest.mark.parametrize(
    ("constrained", "decoupled"),
    [(True, True), (True, False), (False, True)],
    ids=["constrained-decoupled", "constrained-plain-ppo", "free-decoupled"],
)
async def test_the_trainer_trains_constrained_turns_on_policy(
    tiny_model: Path, tmp_path: Path, constrained: bool, decoupled: bool
) -> None:
    config = {"eta": 0, "batch_size": 8, "group_size": 4}
    algo: dict[str, Any] = {
        "ppo_n_minibatches": 1
    }  # one update a step: its ratio is measured first
    if not decoupled:
        algo |= {"decoupled": False, "behav_imp_weight_cap": None}
    async with harness(tiny_model, tmp_path) as h:
        if constrained:
            h.extra = {"response_format": LETTERS, "max_tokens": 3 * MAX_TOKENS}
        run_id = await h.run(config)
        cfg = train_config(run_id, tmp_path, max_steps=2, optim={"lr": 1e-3}, algo=algo, **config)
        backend = build_backend(cfg.backend_config(str(tiny_model)))
        rows: list[dict[str, Any]] = []
        trainer = Trainer(cfg, h.store, backend, LocalPublisher(h.engine), report=rows.append)
        agents = asyncio.create_task(h.agents(run_id, 4, 2))
        await trainer.run()
        agents.cancel()
        await asyncio.gather(agents, return_exceptions=True)
    assert len(rows) == 2
    for r in rows:
        # on-policy (eta 0, one mini-batch): the ratio is 1 and, decoupled, so is the weight
        assert r["ratio_min"] == pytest.approx(1.0, abs=1e-4), r
        assert r["ratio_max"] == pytest.approx(1.0, abs=1e-4), r
        if decoupled:
            assert r["imp_weight_min"] == pytest.approx(1.0, abs=1e-3), r
        if constrained:
            assert r["constrained_tokens"] == r["tokens"] > 0
            assert r["constrained_log_mass"] < -0.05  # the grammar steered: Z well below 1
            if decoupled:
                assert r["mismatch_tokens"] == 0  # they differ by log Z by design
        else:
            assert "constrained_tokens" not in r
            assert r["mismatch_tokens"] == r["tokens"] > 0
