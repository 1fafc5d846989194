"""vLLM's NCCL weight transfer driven by `VLLMEngine` (`join_weight_group`, then a `WeightUpdate`
with a broadcast; GPU machines only).

vLLM (a CUDA build, at $RLGATEWAY_VLLM_PYTHON) serves the tiny model on GPU 0 with
`--weight-transfer-config '{"backend":"nccl"}'`; `tests/support/nccl_sender.py` plays the trainer
on GPU 1 (NCCL cannot put two ranks on one device, hence two GPUs). A request streams while the
new weights are broadcast; it completes with versions 0 then 1, and greedy tokens afterwards are
the new weights' (checked against transformers).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engines.base import (
    Broadcast,
    GenerateRequest,
    SamplingParams,
    TensorMeta,
    WeightGroup,
    WeightUpdate,
    collect,
)
from engines.vllm import VLLMEngine, VLLMEngineConfig
from engines.vllm_launch import VLLMLaunchConfig, VLLMServer
from tests.support.gateway_server import free_port
from tests.support.paths import REPO_ROOT
from tests.support.perturb import perturbed_dir
from tests.support.vllm_server import vllm_python

REPO = REPO_ROOT


@functools.cache
def _gpus() -> int:
    python = vllm_python()
    if python is None or not Path("/dev/nvidia0").exists():
        return 0  # no GPU driver here: skip without starting vLLM's Python
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(_gpus() < 2, reason="needs a CUDA build of vLLM and two GPUs"),
]


async def test_nccl_update_under_a_streaming_request(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    python = vllm_python()
    assert python is not None
    new_dir = perturbed_dir(tiny_model, tmp_path / "v1", seed=2)
    state = load_file(str(new_dir / "model.safetensors"))
    names = sorted(state)
    cfg = VLLMLaunchConfig(
        model=str(tiny_model),
        python=python,
        dtype="float32",
        max_model_len=2048,
        extra_args=("--weight-transfer-config", json.dumps({"backend": "nccl"})),
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    server = VLLMServer(cfg)
    await server.start()
    port = free_port()
    sender = await asyncio.create_subprocess_exec(
        python,
        "-m",
        "tests.support.nccl_sender",
        "127.0.0.1",
        str(port),
        "2",
        cwd=REPO,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "1"},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert sender.stdin is not None
    assert sender.stdout is not None
    engine = await VLLMEngine.connect(VLLMEngineConfig(url=server.url))
    try:
        _, ready = await asyncio.gather(
            engine.join_weight_group(WeightGroup("127.0.0.1", port, 2, backend="nccl")),
            sender.stdout.readline(),
        )
        assert ready.strip() == b"ready"

        async def broadcast() -> None:
            assert sender.stdin is not None
            assert sender.stdout is not None
            sender.stdin.write(f"{new_dir / 'model.safetensors'}\n".encode())
            await sender.stdin.drain()
            assert (await sender.stdout.readline()).strip() == b"sent"

        long = SamplingParams(max_new_tokens=1500, ignore_eos=True)
        request = GenerateRequest(prompt_ids=(1, 2), sampling=long)
        task = asyncio.create_task(collect(engine, request))
        while engine.live_requests == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        metas = tuple(
            TensorMeta(n, str(state[n].dtype).removeprefix("torch."), tuple(state[n].shape))
            for n in names
        )
        update = WeightUpdate(broadcast=Broadcast((metas,)), version=1)
        assert (await asyncio.gather(engine.update_weights(update), broadcast()))[0] == 1
        r = await task
        assert len(r.token_ids) == 1500
        swap = r.versions.index(1)
        assert r.versions == (0,) * swap + (1,) * (1500 - swap)

        greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        g = await collect(engine, GenerateRequest(prompt_ids=(1, 5, 9), sampling=greedy))
    finally:
        await engine.close()
        sender.kill()
        await sender.wait()
        await server.stop()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, *g.token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, 2:-1]
    assert list(g.token_ids) == logits.argmax(-1).tolist()
