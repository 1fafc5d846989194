"""The policy version an engine starts at: an exported model directory's `rlgateway_policy.json`,
`--policy-version` / `RLGATEWAY_POLICY_VERSION` over it, 0 without either; the local engine
stamps its tokens with it, and the vLLM and SGLang adapters start there unless an earlier weight
update labelled the server (`serve --engine-url` and `--engine-launch` alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from engines.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.errors import WeightUpdateError
from engines.local import LocalEngine, LocalEngineConfig
from engines.policy import POLICY_FILE, PolicyFile, read_policy, served_version
from engines.remote import labelled_version
from engines.sglang import SGLangEngine, SGLangEngineConfig
from engines.vllm import VLLMEngine, VLLMEngineConfig
from gateway.remote_engine import connect_engine
from gateway.settings import GatewaySettings
from rlgateway.cli import main
from tests.support.vllm_protocol import FakeVLLM, served


def exported_dir(tmp_path: Path, version: int) -> Path:
    """A model directory as far as the version is concerned: its policy file."""
    model = tmp_path / f"export-v{version}"
    model.mkdir()
    PolicyFile(version=version, step=version, source="/ckpt/step-000001").write(model)
    return model


# -- the policy file ----------------------------------------------------------------------------


def test_the_policy_file_sets_the_version_and_an_override_wins(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    assert read_policy(base) is None
    assert served_version(base) == 0
    assert served_version(base, 4) == 4
    model = exported_dir(tmp_path, 3)
    assert read_policy(model) == PolicyFile(version=3, step=3, source="/ckpt/step-000001")
    assert served_version(model) == 3
    assert served_version(model, 0) == 0  # an explicit 0 is an override, not "unset"


def test_a_broken_policy_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / POLICY_FILE).write_text('{"version": "three", "step": 1, "source": "x"}')
    with pytest.raises(ValueError, match=POLICY_FILE):
        served_version(tmp_path)
    (tmp_path / POLICY_FILE).write_text('{"version": -1, "step": 1, "source": "x"}')
    with pytest.raises(ValueError, match="version must be >= 0"):
        served_version(tmp_path)


def test_the_setting_comes_from_the_environment_and_the_flag_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RLGATEWAY_POLICY_VERSION", raising=False)
    assert GatewaySettings().policy_version is None
    monkeypatch.setenv("RLGATEWAY_POLICY_VERSION", "4")
    assert GatewaySettings().policy_version == 4
    assert main(["serve", "--policy-version", "-1"]) == 2
    assert "policy_version" in capsys.readouterr().err


# -- the local engine ---------------------------------------------------------------------------


async def test_the_local_engine_samples_at_its_configured_version(tiny_model: Path) -> None:
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model), version=4))
    try:
        assert engine.version() == 4
        assert (await engine.health()).version == 4
        sampling = SamplingParams(max_new_tokens=5, ignore_eos=True, seed=1)
        r = await collect(engine, GenerateRequest(prompt_ids=(1, 2, 3), sampling=sampling))
        assert r.versions == (4,) * 5
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(WeightUpdateError, match="not newer"):
            await engine.update_weights(WeightUpdate(state_dict=weights, version=4))
        assert await engine.update_weights(WeightUpdate(state_dict=weights)) == 5
    finally:
        await engine.close()


# -- the remote adapters ------------------------------------------------------------------------


def test_a_label_set_by_an_update_beats_the_starting_version() -> None:
    assert labelled_version("default", 5) == 5  # what vLLM and SGLang say before any update
    assert labelled_version(None, 2) == 2
    assert labelled_version("7", 5) == 7


@pytest.mark.parametrize(("label", "expected"), [("default", 6), ("3", 3)])
async def test_vllm_starts_at_the_configured_version_unless_labelled(
    label: str, expected: int
) -> None:
    fake = FakeVLLM(weight_version=label)
    async with served(fake.app) as url:
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=url, version=6))
        try:
            assert engine.version() == expected
            r = await collect(engine, GenerateRequest(prompt_ids=(1, 2)))
            assert r.versions == (expected,) * 3
            assert (await engine.health()).version == expected
        finally:
            await engine.close()


async def test_sglang_starts_at_the_configured_version_unless_labelled() -> None:
    label = {"weight_version": "default"}
    app = FastAPI()

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "tiny", **label}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"context_length": 64}

    async with served(app) as url:
        engine = await SGLangEngine.connect(SGLangEngineConfig(url=url, version=6))
        assert engine.version() == 6
        await engine.close()
        label["weight_version"] = "9"
        engine = await SGLangEngine.connect(SGLangEngineConfig(url=url, version=6))
        assert engine.version() == 9
        await engine.close()


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The configs of the vLLM servers started through `engines.vllm_launch.VLLMServer`, which
    is replaced by a stand-in whose "server" is a `FakeVLLM` that no update has labelled."""
    import engines.vllm_launch

    configs: list[Any] = []

    class StubServer:
        def __init__(self, cfg: Any) -> None:
            configs.append(cfg)
            self.url = ""
            self._serving = served(FakeVLLM(weight_version="default").app)

        async def start(self) -> None:
            self.url = await self._serving.__aenter__()

        async def stop(self) -> None:
            await self._serving.__aexit__(None, None, None)

    monkeypatch.setattr(engines.vllm_launch, "VLLMServer", StubServer)
    return configs


@pytest.mark.parametrize(("override", "expected"), [(None, 4), (9, 9)])
async def test_the_gateway_connects_vllm_at_the_models_version(
    tmp_path: Path, launched: list[Any], override: int | None, expected: int
) -> None:
    """`serve --engine vllm`: a launched server and a running one (--engine-url) alike start at
    the export's version, or at --policy-version's."""
    model = exported_dir(tmp_path, 4)
    launch = GatewaySettings(
        model=str(model), engine="vllm", engine_launch=True, policy_version=override
    )
    engine = await connect_engine(launch, model, vocab_size=263)
    try:
        assert [cfg.model for cfg in launched] == [str(model)]
        assert engine.version() == expected
        assert isinstance(engine, VLLMEngine)
        running = GatewaySettings(
            model=str(model), engine="vllm", engine_urls=[engine.url], policy_version=override
        )
        other = await connect_engine(running, model, vocab_size=263)
        assert other.version() == expected
        await other.close()
    finally:
        await engine.close()
