"""Training as a user runs it, as real processes: `rlgateway serve --train` (trainer embedded in
the gateway) and `rlgateway serve` + `rlgateway train --gateway-url` (weights published over
disk + POST /admin/weights). Agents drive real sessions over HTTP until the policy version
advances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.tiny_model import tiny_model_dir
from tests.support.deployment import STEPS, drive, run_config
from tests.support.gateway_server import free_port, run_gateway
from tests.support.torchrun import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_serve_with_embedded_trainer(tiny_model: Path, tmp_path: Path, algorithm: str) -> None:
    config = run_config(tmp_path, algorithm=algorithm)
    args = ("--train", "--config", str(config))
    with run_gateway(tiny_model, tmp_path, extra_args=args) as gw:
        drive(gw, gw.trained_run(), STEPS)
        assert gw.client.get("/admin/version").json() == {"version": STEPS}
    last = tmp_path / "ckpt" / f"step-{STEPS:06d}"
    assert last.is_dir()
    assert (last / "critic").is_dir() == (algorithm == "ppo")  # ppo trains and saves a critic


TRAINERS = {
    "one process": (1, "fsdp"),
    "torchrun fsdp:d2": (2, "fsdp:d2"),
    "torchrun archon:e2": (2, "archon:e2"),
    "torchrun megatron:p2": (2, "megatron:p2"),
}
"""How the separate trainer runs: processes and backend (archon on the tiny Qwen3-MoE, which the
gateway then serves; megatron through the CPU harness, its 2 layers on 2 pipeline stages, with
GRPO: it trains no critic)."""


@pytest.mark.parametrize("trainer_kind", list(TRAINERS))
def test_separate_trainer_publishes_to_the_gateway(
    tiny_model: Path, tmp_path: Path, trainer_kind: str
) -> None:
    """The trainer in its own process(es) publishes each version to a running gateway; under
    torchrun rank 0 writes each bucket of `publish.bucket_mb` (one file each) as all ranks gather
    it from their shards, FSDP's, the experts' or the pipeline stages'."""
    nproc, backend = TRAINERS[trainer_kind]
    megatron = backend.startswith("megatron")
    model = tiny_model_dir(moe=True) if backend.startswith("archon") else tiny_model
    with run_gateway(model, tmp_path) as gw:
        run_id = gw.create_run("sep", {"batch_size": 4, "group_size": 2, "eta": 1})
        config = run_config(
            tmp_path,
            run=run_id,
            database_url=gw.database_url,
            model=str(model),
            backend=backend,
            publish={"bucket_mb": 0.25},
        )
        cli = "tests.support.megatron_cpu" if megatron else "rlgateway.cli"
        launcher = [sys.executable, "-m", cli]
        if nproc > 1:
            torchrun = ["-m", "torch.distributed.run", "--master-port", str(free_port())]
            launcher = [sys.executable, *torchrun, "--nproc-per-node", str(nproc), "-m", cli]
        # the preset chosen by a command-line override, with no change to the config file
        algorithm = "grpo" if megatron else "ppo"
        cmd = [*launcher, "train", "--config", str(config),
               "--gateway-url", gw.url, "--admin-token", gw.admin_token,
               f"algorithm={algorithm}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        log = tmp_path / "trainer.log"
        with log.open("w") as out:
            trainer = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                drive(gw, run_id, STEPS)
                assert trainer.wait(timeout=120) == 0, log.read_text()
            finally:
                if trainer.poll() is None:
                    trainer.kill()
                    trainer.wait()
        assert gw.client.get("/admin/version").json() == {"version": STEPS}
        metrics = (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
        assert all(("value_loss" in json.loads(line)) != megatron for line in metrics)
        published = sorted(p.name for p in (tmp_path / "ckpt" / "published").iterdir())
        assert published == [f"v{v}" for v in range(1, STEPS + 1)]
        shards = list((tmp_path / "ckpt" / "published" / f"v{STEPS}").glob("*.safetensors"))
        assert len(shards) > 1  # buckets of 0.25 MiB: the tiny models' 1.8 MiB go in several
        r = gw.client.post("/admin/weights", json={"path": str(tmp_path / "nope")})
        assert r.status_code == 400
