"""A test harness that runs megatron-core's dense GPT on CPU over gloo (never shipped code).

megatron-core is written for CUDA: its layers allocate with `device=torch.cuda.current_device()`
or `device="cuda"`, its pipeline schedule synchronises CUDA, and dropout and activation
recomputation go through a CUDA RNG tracker. `install()` redirects exactly those calls in this
process, before the backend is built:

- `torch.cuda.current_device()` returns "cpu", `torch.cuda.synchronize()` does nothing;
- torch's tensor factories (`torch.zeros`, `torch.empty`, ...) take a CUDA `device=` argument
  as the CPU (wrapped functions, not a torch function mode: a mode is per thread, and the
  trainer runs the backend in a worker thread);
- the RNG tracker's `fork()` is a no-op and recomputation's CUDA RNG save/restore does nothing
  (the tiny models have no dropout);
- it marks megatron-core as shimmed, which `trainer.backends.megatron` requires on a CPU.

Nothing else changes: the layers, the tensor-parallel collectives (over gloo) and the pipeline
schedule are megatron-core's own. `python -m tests.support.megatron_cpu train ...` is
`rlgateway train ...` with the harness applied (what the separate-trainer test launches under
torchrun).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint")
"""The torch factories megatron-core calls with a CUDA device (not `torch.tensor`: transformers
builds its rotary buffers wrong once that is a Python function)."""


def _on_cpu(factory: Any) -> Any:
    """`factory` with a CUDA `device=` argument (a "cuda" string, a CUDA device or a device
    index) replaced by the CPU."""

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


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
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    core._rlgateway_cpu_shim = True
    _installed = True


if __name__ == "__main__":
    import sys

    install()
    from rlgateway.cli import main

    sys.exit(main())
