"""One decode step of the local engine's forward (`engines.slot_model.SlotModel.decode`), alone.

For each weight dtype and batch size B, B sequences are prefilled with `--prompt-tokens` tokens and
then decoded step after step; a row gives the median milliseconds of a step (and B / step, the
tokens/s a decode-only engine would make) for:

- plain: each projection a `torch.nn.functional.linear` on the module's weight (as before);
- packed: the projections on weights prepacked for oneDNN, q/k/v and gate/up fused
  (`engines.packed_linear`, the engine's default on a CPU);
- and, in bfloat16, the attention and KV cache in bfloat16 rather than float32 (`plain, bf16
  attention`: what the engine did before its cache stayed float32 on a CPU).

The variants alternate step by step within a repeat, so machine noise hits them alike. Run from
the repository root:

    .venv/bin/python bench/bench_decode_step.py --model smollm2
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model directory")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per variant")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from engines.slot_model import SlotModel
    from rlgateway.models import resolve_model

    model_dir = resolve_model(args.model, Path.cwd())
    top = max(args.batch)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        variants = {
            "plain": SlotModel(model, max_slots=top, max_model_len=1024, packed=False),
            "packed": SlotModel(model, max_slots=top, max_model_len=1024, packed=True),
        }
        if dtype != torch.float32:
            variants["plain, bf16 attention"] = SlotModel(
                model, max_slots=top, max_model_len=1024, packed=False, cache_dtype=dtype
            )
        for B in args.batch:
            prompts = [
                [1 + (b * 131 + t * 7) % 1000 for t in range(args.prompt_tokens)] for b in range(B)
            ]
            for runner in variants.values():
                runner.prefill_batch(0, prompts)
                for i in range(2):  # warm-up
                    runner.decode([5] * B, [args.prompt_tokens + i] * B)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for step in range(args.steps):
                pos = [args.prompt_tokens + 2 + step] * B
                for name, runner in variants.items():
                    t0 = time.perf_counter()
                    runner.decode([5] * B, pos)
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            rows.append((dtype_name, B, med))
            print(
                f"  {dtype_name} B={B}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()),
                flush=True,
            )
        del variants, model

    print("| dtype | B | variant | step ms | tokens/s | plain / variant |")
    print("|---|---:|---|---:|---:|---:|")
    for dtype_name, B, med in rows:
        for name, sec in med.items():
            print(
                f"| {dtype_name} | {B} | {name} | {sec * 1e3:.1f} | {B / sec:,.0f} | "
                f"{med['plain'] / sec:.2f}x |"
            )
    print()
    print(
        f"model {args.model}, prompts of {args.prompt_tokens} tokens, median of {args.steps} "
        f"steps; torch {torch.__version__} ({torch.get_num_threads()} threads), python "
        f"{platform.python_version()}; {datetime.date.today().isoformat()}"
    )


if __name__ == "__main__":
    main()
