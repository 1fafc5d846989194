"""The local engine tests' engines and reference models (each test module gets its own)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.local import LocalEngine, LocalEngineConfig


@pytest.fixture(scope="module")
def shared_engine(tiny_model: Path) -> Iterator[LocalEngine]:
    """One engine for tests that neither pause it nor change its weights."""
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[LocalEngine]:
    """A fresh engine for tests that pause it, swap its weights or close it."""
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_model)))
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """The model loaded separately, for teacher-forced reference passes."""
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe_engine(tiny_moe_model: Path) -> Iterator[LocalEngine]:
    """An engine on the tiny Qwen3-MoE, for the parity tests."""
    engine = LocalEngine.load(LocalEngineConfig(model=str(tiny_moe_model)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def moe_reference(tiny_moe_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()
