"""What a burst of long prompts costs the embedded engine's other work, per prefill budget.

A step of the local engine admits waiting requests up to `max_prefill_tokens` prompt tokens
(`engines.local_worker`). This bench starts `--live` requests that decode for a long time, then
submits a burst of `--burst` requests with `--prompt-tokens`-token prompts at once and, right
after it, a weight update (the same weights under the next version, as a trainer's publish
would arrive). For each budget it reports:

- `update s`: from the update's submission until the engine applied it (a publish's wait);
- `live gap s`: the longest wait of a live request between two of its tokens during the burst;
- `burst s`: from the burst's submission until its last request finished;
- `tokens/s`: every token generated (live and burst) over the whole run.

Budgets run interleaved, `--repeats` times each, and the table gives medians; the largest
budget (default 1,000,000) admits the whole burst in one step, as the engine did before it had
a budget. Run from the repository root:

    .venv/bin/python bench/bench_prefill_budget.py                  # the tiny test model
    .venv/bin/python bench/bench_prefill_budget.py --model smollm2  # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="smollm2 or a model directory (default: the tiny test model)")
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096, 1_000_000])
    p.add_argument("--live", type=int, default=8, help="requests decoding when the burst comes")
    p.add_argument("--burst", type=int, default=32, help="requests in the burst")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens of each")
    p.add_argument("--burst-tokens", type=int, default=16, help="tokens each burst request makes")
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


@dataclass(slots=True)
class Result:
    update_s: float
    live_gap_s: float
    burst_s: float
    tokens_per_s: float


async def one_run(engine: Any, args: argparse.Namespace, vocab: int, seed: int) -> Result:
    from engines.base import GenerateRequest, SamplingParams, WeightUpdate

    rng = random.Random(seed)
    arrivals: list[list[float]] = [[] for _ in range(args.live)]
    counts = [0]

    async def live(i: int, started: asyncio.Event) -> None:
        prompt = tuple(rng.randrange(vocab) for _ in range(16))
        # as long as the context allows: they are cancelled once the burst is done
        sampling = SamplingParams(max_new_tokens=engine.max_model_len - 16, ignore_eos=True)
        async for chunk in engine.generate(GenerateRequest(prompt_ids=prompt, sampling=sampling)):
            arrivals[i].append(time.perf_counter())
            counts[0] += len(chunk.token_ids)
            started.set()
            if chunk.finish_reason is not None:
                return

    async def burst_one(prompt: tuple[int, ...]) -> None:
        sampling = SamplingParams(max_new_tokens=args.burst_tokens, ignore_eos=True)
        async for chunk in engine.generate(GenerateRequest(prompt_ids=prompt, sampling=sampling)):
            counts[0] += len(chunk.token_ids)

    t0 = time.perf_counter()
    events = [asyncio.Event() for _ in range(args.live)]
    lives = [asyncio.create_task(live(i, e)) for i, e in enumerate(events)]
    for e in events:
        await e.wait()
    await asyncio.sleep(0.5)  # the live requests decode together before the burst comes
    prompts = [
        tuple(rng.randrange(vocab) for _ in range(args.prompt_tokens)) for _ in range(args.burst)
    ]
    burst_start = time.perf_counter()
    burst = asyncio.gather(*(burst_one(p) for p in prompts))
    await asyncio.sleep(0)  # the burst is queued before the update
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    update_start = time.perf_counter()
    await engine.update_weights(WeightUpdate(state_dict=state))
    update_s = time.perf_counter() - update_start
    await burst
    burst_end = time.perf_counter()
    for task in lives:
        task.cancel()
    await asyncio.gather(*lives, return_exceptions=True)
    total = time.perf_counter() - t0
    gaps = [
        b - a
        for times in arrivals
        for a, b in itertools.pairwise(times)
        if b >= burst_start and a <= burst_end
    ]
    return Result(update_s, max(gaps, default=0.0), burst_end - burst_start, counts[0] / total)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from engines.local import LocalEngine, LocalEngineConfig
    from engines.tiny_model import tiny_model_dir
    from rlgateway.models import resolve_model

    model_dir = resolve_model(args.model, Path.cwd()) if args.model else tiny_model_dir()
    results: dict[int, list[Result]] = {b: [] for b in args.budgets}
    max_batch = args.live + args.burst
    for repeat in range(args.repeats):
        for budget in args.budgets:
            config = LocalEngineConfig(
                model=str(model_dir), device="cpu", max_batch=max_batch, max_prefill_tokens=budget
            )
            engine = LocalEngine.load(config)
            try:
                vocab = int(engine.model.config.vocab_size)
                r = asyncio.run(one_run(engine, args, vocab, seed=repeat))
            finally:
                asyncio.run(engine.close())
            results[budget].append(r)
            print(f"# repeat {repeat} budget {budget}: {r}", flush=True)

    print(
        f"\n{model_dir.name}: {args.live} live requests, a burst of {args.burst} x "
        f"{args.prompt_tokens}-token prompts and a weight update; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}, "
        f"{datetime.date.today().isoformat()}, median of {args.repeats}\n"
    )
    print("| max_prefill_tokens | update s | live gap s | burst s | tokens/s |")
    print("|---:|---:|---:|---:|---:|")
    for budget, rs in results.items():

        def med(field: str, rs: list[Result] = rs) -> float:
            return statistics.median(getattr(r, field) for r in rs)

        print(
            f"| {budget:,} | {med('update_s'):.2f} | {med('live_gap_s'):.2f} | "
            f"{med('burst_s'):.2f} | {med('tokens_per_s'):.0f} |"
        )


if __name__ == "__main__":
    main()
