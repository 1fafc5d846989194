"""An experiment spec's `engine` section: what it sets on the embedded gateway's engine, the
overrides that reach it, and the refusals (an unknown key; a running deployment's own engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlgateway.experiment.deploy import LocalDeployment
from rlgateway.experiment.runner import Experiment
from tests.support.experiment import write_spec


def test_engine_keys_and_overrides_set_the_gateway_settings(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec", [{"q": "x", "mode": "ok"}], engine={"max_batch": 4})
    assert Experiment.from_yaml(spec).spec.engine.settings() == {"max_batch": 4}
    exp = Experiment.from_yaml(spec, ["engine.dtype=bfloat16", "engine.threads=1"])
    assert exp.spec.engine.settings() == {"dtype": "bfloat16", "max_batch": 4, "engine_threads": 1}
    with pytest.raises(ValueError, match="dtyp"):
        Experiment.from_yaml(spec, ["engine.dtyp=bfloat16"])
    with pytest.raises(ValueError, match="dtype"):
        Experiment.from_yaml(spec, ["engine.dtype=int8"])


def test_a_running_deployment_keeps_its_own_engine(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec", [{"q": "x", "mode": "ok"}], engine={"dtype": "bfloat16"})
    exp = Experiment.from_yaml(spec, gateway_url="http://127.0.0.1:9", admin_token="t")
    with pytest.raises(ValueError, match=r"engine: dtype set the embedded gateway's engine"):
        exp.prepare()


async def test_the_embedded_gateway_runs_the_engine_the_spec_sets(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "spec",
        [{"q": "x", "mode": "ok"}],
        engine={"dtype": "bfloat16", "max_prefill_tokens": 32, "threads": 1},
    )
    exp = Experiment.from_yaml(spec, out=tmp_path / "out")
    parts = exp.prepare()
    parts.reward.close()
    dep = await LocalDeployment.start(
        parts.cfg,
        name="exp",
        model_dir=parts.model_dir,
        out=tmp_path / "out",
        served_model_name="policy",
        engine=exp.spec.engine.settings(),
    )
    try:
        config = dep._c.engine.config  # type: ignore[union-attr]
        assert (config.dtype, config.max_prefill_tokens) == ("bfloat16", 32)
    finally:
        await dep.close()
