"""`rlgateway serve --model EXPORT` on the local engine serves the trained policy at its version:
a real gateway (the engine in its own process, the default, and `--in-process-engine`) records
sampled tokens whose logprobs are the trainer's teacher-forced ones and whose version is the
export's (or `--policy-version`'s), and `/health` says so; editing the export's version file
changes the version its tokens carry."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.base import GenerateRequest, SamplingParams, collect
from engines.local import LocalEngine, LocalEngineConfig
from engines.policy import PolicyFile, read_policy, served_version
from tests.support.deployment import drive, run_config
from tests.support.exported_policy import (
    VERSION,
    Exported,
    check_recorded_at,
    export_trained,
)
from tests.support.gateway_server import run_gateway

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
PARITY = 1e-4
"""The local engine's float32 forward (its own KV-cache kernels) vs the trainer's."""


@pytest.fixture(scope="module")
def exported(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return export_trained(tiny_model, tmp_path_factory.mktemp("exported"))


@pytest.mark.parametrize(
    ("args", "version"),
    [((), VERSION), (("--in-process-engine", "--policy-version", "7"), 7)],
    ids=["engine-process", "in-process-override"],
)
def test_the_gateway_records_the_exported_policy_at_its_version(
    exported: Exported, tmp_path: Path, args: tuple[str, ...], version: int
) -> None:
    with run_gateway(exported.out, tmp_path, extra_args=args) as gw:
        check_recorded_at(exported, gw, version, TEMPERATURE, PARITY)


async def test_the_exports_version_file_sets_the_version_its_tokens_carry(
    exported: Exported, tmp_path: Path
) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(exported.out, edited)
    policy = read_policy(edited)
    assert policy is not None
    PolicyFile(version=12, step=policy.step, source=policy.source).write(edited)
    engine = LocalEngine.load(LocalEngineConfig(model=str(edited), version=served_version(edited)))
    try:
        sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=TEMPERATURE)
        r = await collect(engine, GenerateRequest(prompt_ids=(1, 2, 3), sampling=sampling))
    finally:
        await engine.close()
    assert r.versions == (12,) * 4


def test_serve_train_on_an_export_continues_from_its_version(
    exported: Exported, tmp_path: Path
) -> None:
    """`serve --train` on an exported policy with a fresh checkpoint_dir: the trainer's weights
    are the export (served as VERSION), so its first step publishes VERSION + 1 (it published 1
    before, which the engine refused as older than what it serves)."""
    config = run_config(tmp_path, max_steps=1)
    with run_gateway(exported.out, tmp_path, extra_args=("--train", "--config", str(config))) as gw:
        drive(gw, gw.trained_run(), VERSION + 1)
        assert gw.client.get("/admin/version").json() == {"version": VERSION + 1}
        assert "Traceback" not in gw.log_path.read_text()
