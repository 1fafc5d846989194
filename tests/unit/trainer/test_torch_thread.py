"""The trainer's torch work runs on one thread, whichever task asks, in the order asked
(`trainer.torch_thread`: glibc keeps a thread's freed memory for that thread, so a pool of threads
each kept a training step's peak)."""

from __future__ import annotations

import asyncio
import threading

from trainer.torch_thread import on_torch_thread


async def test_every_call_runs_on_the_one_torch_thread_in_order() -> None:
    ran: list[tuple[int, str]] = []

    def work(k: int) -> int:
        ran.append((k, threading.current_thread().name))
        return k * k

    results = await asyncio.gather(*(on_torch_thread(work, k) for k in range(8)))
    assert results == [k * k for k in range(8)]
    assert [k for k, _ in ran] == list(range(8))
    names = {name for _, name in ran}
    assert len(names) == 1
    assert names.pop().startswith("rlgateway-torch")
    assert threading.current_thread() is threading.main_thread()
