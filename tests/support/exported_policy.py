"""A trained policy, checkpointed and exported, for the tests that serve an export.

`export_trained(model_dir, tmp)` trains the FSDP backend on the tiny model for the fixed run of
`fsdp_worker` (3 real optimizer steps), saves the checkpoint through `trainer.checkpoint` as the
training loop does, and runs `rlgateway export-model` on the checkpoint root. The returned
`Exported` keeps the trained backend, so a test compares what an engine serving the export
samples with the trainer's own teacher-forced logprobs of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from rlgateway.cli import main
from tests.support.teacher import teacher_forced
from tests.support.workers import fsdp_worker
from trainer import checkpoint
from trainer.backends.fsdp import FSDPBackend

if TYPE_CHECKING:
    from tests.support.gateway_server import GatewayHandle

VERSION = fsdp_worker.STEPS
"""The policy version of the exported checkpoint: the trainer publishes step N as version N."""


@dataclass(frozen=True)
class Exported:
    backend: FSDPBackend
    """The trained policy, in the test's process."""
    root: Path
    """The checkpoint_dir."""
    checkpoint: Path
    """The checkpoint exported (the newest under `root`)."""
    out: Path
    """The exported model directory."""

    def logprobs(self, tokens: list[int], temperature: float) -> list[float]:
        """The trainer's teacher-forced logprob of every token (entry 0 is 0)."""
        return teacher_forced(self.backend, tokens, temperature)


def export_trained(model_dir: Path, tmp: Path) -> Exported:
    """Train, checkpoint and export (see the module doc) under `tmp`."""
    backend = fsdp_worker.build_backend(model_dir)
    fsdp_worker.train(backend, fsdp_worker.make_sequences())
    assert backend.step == VERSION
    root = tmp / "checkpoints"
    meta = checkpoint.CheckpointMeta(backend.step, consumed=["s-1"], dropped={})
    saved = checkpoint.save(root, backend, meta, keep=2)
    out = tmp / "export"
    assert main(["export-model", str(root), str(out)]) == 0
    return Exported(backend, root, saved, out)


def record_turn(gw: GatewayHandle, temperature: float, max_tokens: int = 24) -> dict[str, Any]:
    """One chat turn through a new session of `gw` (`max_tokens` sampled, eos ignored); the
    session's one recorded segment."""
    session = gw.new_session()
    r = httpx.post(
        f"{session['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json={
            "model": "any",
            "messages": [{"role": "user", "content": "Write exactly five lowercase letters."}],
            "temperature": temperature,
            "seed": 3,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    [segment] = gw.session(session["id"])["segments"]
    assert sum(segment["loss_mask"]) == max_tokens
    return dict(segment)


def max_gap_to_the_trainer(
    exported: Exported, segment: dict[str, Any], temperature: float
) -> float:
    """The largest |recorded - trainer's teacher-forced| logprob over the sampled tokens."""
    expected = exported.logprobs(segment["tokens"], temperature)
    return max(
        abs(lp - expected[i])
        for i, (lp, m) in enumerate(zip(segment["logprobs"], segment["loss_mask"], strict=True))
        if m
    )


def check_recorded_at(
    exported: Exported, gw: GatewayHandle, version: int, temperature: float, parity: float
) -> None:
    """A gateway serving the export reports `version`, and a turn it records carries `version`
    on every sampled token, with logprobs within `parity` of the trained policy's."""
    health = httpx.get(f"{gw.url}/health", timeout=10).json()
    assert (health["ok"], health["version"]) == (True, version)
    segment = record_turn(gw, temperature)
    sampled = [v for v, m in zip(segment["versions"], segment["loss_mask"], strict=True) if m]
    assert sampled == [version] * len(sampled)
    gap = max_gap_to_the_trainer(exported, segment, temperature)
    assert gap <= parity, f"max |engine - trainer| logprob = {gap:.2e}"
