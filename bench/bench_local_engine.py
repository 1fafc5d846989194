"""Generated tokens/s of the embedded local engine, side by side with plain Hugging Face generate.

For each concurrency C the same C chat-rendered prompts (20-60 tokens) each get exactly
`--max-tokens` sampled tokens (temperature 1, no top-k/top-p, eos ignored) from:

- the local engine: all C requests in flight at once (`asyncio.gather` of `collect`);
- HF generate, sequential: one `model.generate` call per request, one after another, KV cache on
  (what a naive user writes);
- HF generate, batched: the C prompts left-padded into one `model.generate` call (static
  batching, the fair comparison);
- optionally vLLM (`--vllm-url`, or `--start-vllm` to start one on the same model): the C
  requests in flight at once against `/v1/completions` with token-id prompts.

Each repeat runs every method once, interleaved, so machine noise hits them alike; a row reports
the median (or best) of the repeats, and each ratio the median of the per-repeat ratios. Torch's
intra-op threads (`OMP_NUM_THREADS`) apply to the engine and HF alike. Run from the repository
root:

    .venv/bin/python bench/bench_local_engine.py --model-size test --concurrency 1 8 32 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from engines.local import LocalEngine

REPO_ROOT = Path(__file__).resolve().parents[1]
LETTERS = "abcdefghijklmnopqrstuvwxyz     "  # about one space in six, like words


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-size", default="test", help="tiny model size: test or demo")
    p.add_argument("--model", help="smollm2 or a model directory instead of a tiny model")
    p.add_argument(
        "--skip-hf-seq", action="store_true", help="leave out the one-at-a-time HF baseline"
    )
    p.add_argument("--seed", type=int, default=0, help="tiny model weights seed")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations of the engine, HF and vLLM alike",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method and row")
    p.add_argument("--stat", choices=["median", "best"], default="median")
    p.add_argument("--vllm-url", help="also run the workload against this vLLM server")
    p.add_argument("--start-vllm", action="store_true", help="start a vLLM server on the model")
    args = p.parse_args(argv)
    if args.vllm_url and args.start_vllm:
        p.error("pass --vllm-url or --start-vllm, not both")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--concurrency, --max-tokens and --repeats must be positive")
    return args


def make_prompts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """`n` chat-rendered single-turn prompts of 20-60 tokens (lengths drawn uniformly)."""
    rng = random.Random(seed)

    def render(content: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    overhead = len(render(""))
    prompts = []
    for _ in range(n):
        target = rng.randint(20, 60)
        content = "".join(rng.choice(LETTERS) for _ in range(max(1, target - overhead)))
        prompts.append(render(content))
    return prompts


# -- the methods: each generates max_tokens for every prompt and returns the tokens it got ------


async def engine_run(engine: LocalEngine, prompts: list[list[int]], max_tokens: int) -> int:
    from engines.base import GenerateRequest, SamplingParams, collect

    sp = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, ignore_eos=True)
    results = await asyncio.gather(
        *(collect(engine, GenerateRequest(prompt_ids=tuple(p), sampling=sp)) for p in prompts)
    )
    return sum(len(r.token_ids) for r in results)


def hf_generate(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> int:
    """One `generate` call over `prompts`, left-padded to one length. Returns the new tokens."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        use_cache=True,
        pad_token_id=pad_id,
    )
    new = int(out.shape[1]) - width
    assert new == max_tokens, f"HF generate made {new} tokens, not {max_tokens}"
    return len(prompts) * new


def hf_sequential(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> int:
    return sum(hf_generate(model, [p], max_tokens, pad_id) for p in prompts)


async def vllm_run(
    client: httpx.AsyncClient, model: str, prompts: list[list[int]], max_tokens: int
) -> int:
    async def one(prompt: list[int]) -> int:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        got: int = resp.json()["usage"]["completion_tokens"]
        return got

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


# -- timing --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    concurrency: int
    runs: dict[str, list[float]]
    """tokens/s of each timed run, per method; run i of every method ran back to back."""
    mean_decode_batch: float

    def rate(self, method: str, stat: str) -> float:
        return _pick(self.runs[method], stat)

    def ratio(self, a: str, b: str, stat: str) -> float:
        """a/b: the median of the per-run ratios (pairs ran back to back, so shared noise
        cancels), or the ratio of the best runs."""
        if stat == "best":
            return max(self.runs[a]) / max(self.runs[b])
        return statistics.median(x / y for x, y in zip(self.runs[a], self.runs[b], strict=True))


def _pick(values: list[float], stat: str) -> float:
    return statistics.median(values) if stat == "median" else max(values)


def timed(fn: Callable[[list[list[int]]], int], prompts: list[list[int]], expected: int) -> float:
    """Tokens/s of `fn(prompts)`, which must produce `expected` tokens."""
    t0 = time.perf_counter()
    tokens = fn(prompts)
    elapsed = time.perf_counter() - t0
    assert tokens == expected, f"got {tokens} tokens, expected {expected}"
    return tokens / elapsed


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, model_dir: Path) -> Iterator[str | None]:
    if args.vllm_url:
        yield args.vllm_url.rstrip("/")
        return
    if not args.start_vllm:
        yield None
        return
    # tests/ is not an installed package: import the helper from this checkout.
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.vllm_server import start_vllm_server, vllm_python

    if vllm_python() is None:
        raise SystemExit("--start-vllm: no vLLM found (see tests/support/vllm_server.py)")
    print(f"starting vLLM on {model_dir} ...", file=sys.stderr, flush=True)
    with start_vllm_server(model_dir, dtype=args.dtype) as url:
        yield url.rstrip("/")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    busy_before = cpu_busy(2.0)  # other work on the machine skews every column
    import httpx
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from engines.local import LocalEngine, LocalEngineConfig
    from engines.tiny_model import load_tokenizer, tiny_model_dir
    from rlgateway.models import resolve_model

    if args.model:
        model_dir = resolve_model(args.model, Path.cwd())
    else:
        model_dir = tiny_model_dir(size=args.model_size, seed=args.seed)
    tokenizer = load_tokenizer(model_dir)
    pad_id = int(tokenizer.pad_token_id)
    top = max(args.concurrency)
    prompts = make_prompts(tokenizer, top)
    n = args.max_tokens

    with asyncio.Runner() as runner, contextlib.ExitStack() as stack:
        url = stack.enter_context(vllm_server(args, model_dir))
        hf: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, args.dtype)
        )
        hf.eval()
        engine = LocalEngine.load(
            LocalEngineConfig(model=str(model_dir), device="cpu", dtype=args.dtype, max_batch=top)
        )
        stack.callback(lambda: runner.run(engine.close()))
        methods: dict[str, Callable[[list[list[int]]], int]] = {
            "engine": lambda ps: runner.run(engine_run(engine, ps, n)),
            "hf_seq": lambda ps: hf_sequential(hf, ps, n, pad_id),
            "hf_batch": lambda ps: hf_generate(hf, ps, n, pad_id),
        }
        if args.skip_hf_seq:
            del methods["hf_seq"]
        if url is not None:
            client = httpx.AsyncClient(
                base_url=url,
                timeout=600,
                limits=httpx.Limits(max_connections=top, max_keepalive_connections=top),
            )
            stack.callback(lambda: runner.run(client.aclose()))
            served = runner.run(client.get("/v1/models")).json()["data"][0]["id"]
            methods["vllm"] = lambda ps: runner.run(vllm_run(client, served, ps, n))

        rows = []
        for c in args.concurrency:
            batch = prompts[:c]
            # Warm-up at this batch size (grows caches; vLLM's CPU backend compiles per shape);
            # the sequential baseline runs one prompt at a time whatever C is.
            for name, fn in methods.items():
                fn(batch[:1] if name == "hf_seq" else batch)
            rates: dict[str, list[float]] = {name: [] for name in methods}
            steps0, tokens0 = engine.stats.decode_steps, engine.stats.decode_tokens
            for _ in range(args.repeats):
                for name, fn in methods.items():
                    rates[name].append(timed(fn, batch, c * n))
            steps = engine.stats.decode_steps - steps0
            mean_batch = (engine.stats.decode_tokens - tokens0) / steps if steps else 0.0
            rows.append(Row(c, rates, mean_batch))
            runs = "; ".join(f"{k} " + " ".join(f"{x:.0f}" for x in v) for k, v in rates.items())
            print(f"  C={c} tok/s per run: {runs}", file=sys.stderr)

    versions = (torch.__version__, transformers.__version__)
    print_report(args, rows, url is not None, versions, busy_before)


def print_report(
    args: argparse.Namespace,
    rows: list[Row],
    with_vllm: bool,
    versions: tuple[str, str],
    busy_before: float,
) -> None:
    import torch

    torch_v, tf_v = versions
    cols = ["concurrent", "engine tok/s", "HF generate seq tok/s", "HF generate batched tok/s"]
    cols += ["engine / HF seq", "engine / HF batched", "mean decode batch"]
    if with_vllm:
        cols += ["vLLM tok/s", "engine / vLLM"]
    print(f"| {' | '.join(cols)} |")
    print(f"|{'|'.join('---:' for _ in cols)}|")
    for r in rows:
        st = args.stat
        cells = [f"{r.concurrency}"]
        seq = "hf_seq" in r.runs
        cells += [f"{r.rate(m, st):,.0f}" if m in r.runs else "-" for m in ("engine", "hf_seq")]
        cells += [f"{r.rate('hf_batch', st):,.0f}"]
        cells += [f"{r.ratio('engine', 'hf_seq', st):.1f}x" if seq else "-"]
        cells += [f"{r.ratio('engine', 'hf_batch', st):.2f}x", f"{r.mean_decode_batch:.1f}"]
        if with_vllm:
            cells += [f"{r.rate('vllm', st):,.0f}", f"{r.ratio('engine', 'vllm', st):.2f}x"]
        print(f"| {' | '.join(cells)} |")
    cpu = _cpu_model()
    print()
    print(
        f"tok/s: {args.stat} of {args.repeats} runs; ratios: "
        f"{'median of the per-run ratios' if args.stat == 'median' else 'best over best'}; "
        f"model {args.model or 'tiny-' + args.model_size} ({args.dtype}), "
        f"{args.max_tokens} new tokens per request, prompts 20-60 tokens, temperature 1."
    )
    print(
        f"machine: {cpu}, {len(os.sched_getaffinity(0))} usable cores; python "
        f"{platform.python_version()}, torch {torch_v} ({torch.get_num_threads()} threads), "
        f"transformers {tf_v}; {datetime.date.today().isoformat()}; CPU busy with other work "
        f"just before the run: {busy_before:.0%}"
    )


def cpu_busy(seconds: float) -> float:
    """The fraction of all cores busy (user, nice, system; not iowait) over `seconds`."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:3]), sum(fields[:8])

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
