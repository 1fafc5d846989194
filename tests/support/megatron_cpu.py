"""A test harness that runs megatron-core's dense GPT on CPU over gloo (never shipped code).

megatron-core is written for CUDA: its layers allocate with `device=torch.cuda.current_device()`
or `device="cuda"`, its pipeline schedule synchronises CUDA, and dropout and activation
recomputation go through a CUDA RNG tracker. `install()` redirects exactly those calls in this
process, before the backend is built:

- `torch.cuda.current_device()` returns "cpu", `torch.cuda.synchronize()` does nothing;
- a torch function mode rewrites a CUDA `device=` argument of any torch call to the CPU;
- the RNG tracker's `fork()` is a no-op and recomputation's CUDA RNG save/restore does nothing
  (the tiny models have no dropout);
- it marks megatron-core as shimmed, which `trainer.backends.megatron` requires on a CPU.

Nothing else changes: the layers, the tensor-parallel collectives (over gloo) and the pipeline
schedule are megatron-core's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _CpuDevices(TorchFunctionMode):
    """Every torch call's CUDA `device=` argument (a "cuda" string, a CUDA device, or a device
    index) replaced by the CPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_installed = False


def install() -> None:
    """Redirect megatron-core's CUDA calls to the CPU in this process (idempotent)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from trainer.backends.megatron import import_megatron

    core = import_megatron()
    from megatron.core.tensor_parallel import random as rng

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]

    class _Tracker(rng.CudaRNGStatesTracker):  # type: ignore[misc]
        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            yield

    rng._CUDA_RNG_STATE_TRACKER = _Tracker()
    rng._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    rng._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda *args, **kwargs: None
    _CpuDevices().__enter__()
    core._rlgateway_cpu_shim = True
    _installed = True
