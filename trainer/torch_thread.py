"""One thread for the trainer's torch work in a process that also serves (the embedded trainer,
`rlgateway run`, the demo): every forward, backward, optimizer step, checkpoint and weight gather
of the trainer runs on it, never on the event loop and never on a pool of threads.

Why one: glibc's malloc gives each thread its own arena and keeps what a thread freed for that
thread to reuse. A training step's activations are many tensors of a few MB (under malloc's
dynamic mmap threshold), so a step that lands on a pool thread it never ran on before leaves its
whole peak resident there: measured on SmolLM2-135M, 32 multi-turn episodes a step
(token_budget 2048), 3.4 GB more resident memory for each new thread, 21.5 GB after six steps
on six threads, where one thread stays at 5.2-5.9 GB; `asyncio.to_thread`'s pool did exactly
that, and a 30-minute multi-turn run was killed for memory at its fourth step.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlgateway-torch")


async def on_torch_thread(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`fn(*args, **kwargs)` on the trainer's torch thread, awaited (calls run one at a time, in
    the order they were made)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))
