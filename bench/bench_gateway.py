"""Gateway overhead: the same chat requests straight to the local engine in-process, and through
`rlgateway serve` over HTTP (recorded into sessions in the store), side by side in one run.

    .venv/bin/python bench/bench_gateway.py [--clients 64] [--requests 4] [--max-tokens 32]
        [--database-url postgresql://...]

Each of C concurrent clients sends R requests one after another; every request is a fresh
single-turn chat (its own session through the gateway) with the same seeds on both sides, so both
sides sample the same tokens. Latency is measured per request from send to the full response.
Prints a markdown table: p50/p99 latency, throughput, and the gateway's added latency and
throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ADMIN = "bench-admin"


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Question {i}: what is {i} + {i * 7 % 13}?"}]
        for i in range(n)
    ]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def direct(model_dir: Path, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    from engines.base import GenerateRequest, SamplingParams, collect
    from engines.local import LocalEngine, LocalEngineConfig
    from engines.tiny_model import load_tokenizer

    tok = load_tokenizer(model_dir)
    engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir)))
    prompts = _prompts(clients * requests)
    latencies: list[float] = []
    tokens = 0

    async def client(c: int) -> None:
        nonlocal tokens
        for r in range(requests):
            i = c * requests + r
            text = tok.apply_chat_template(prompts[i], add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            sp = SamplingParams(seed=i, max_new_tokens=max_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            res = await collect(engine, GenerateRequest(prompt_ids=tuple(ids), sampling=sp))
            latencies.append(time.perf_counter() - t0)
            tokens += len(res.token_ids)

    await client(0)  # warm-up
    latencies.clear()
    tokens = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    await engine.close()
    return {"latencies": latencies, "tokens": tokens, "wall": wall}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def through_gateway(
    model_dir: Path, clients: int, requests: int, max_tokens: int, database_url: str | None
) -> dict[str, Any]:
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    db = database_url or f"sqlite:///{tmp / 'bench.db'}"
    env = {**os.environ, "RLGATEWAY_ADMIN_TOKEN": ADMIN}
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--database-url",
        db,
        "--log-level",
        "warning",
    ]
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            return asyncio.run(_gateway_clients(base, tmp, clients, requests, max_tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _gateway_clients(
    base: str, tmp: Path, clients: int, requests: int, max_tokens: int
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        for _ in range(600):
            try:
                if (await http.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError((tmp / "serve.log").read_text()[-2000:])
        auth = {"Authorization": f"Bearer {ADMIN}"}
        run = (await http.post("/runs", json={"name": "bench"}, headers=auth)).json()
        total = clients * requests + 1
        sessions: list[dict[str, Any]] = []
        while len(sessions) < total:
            n = min(1024, total - len(sessions))
            out = await http.post(f"/runs/{run['id']}/sessions", json={"count": n}, headers=auth)
            sessions += out.json()["sessions"]
        prompts = _prompts(clients * requests)
        latencies: list[float] = []
        tokens = 0

        async def client(c: int, warm: bool = False) -> None:
            nonlocal tokens
            for r in range(requests):
                i = c * requests + r
                s = sessions[-1] if warm else sessions[i]
                body = {
                    "model": "tiny",
                    "messages": prompts[i],
                    "seed": i,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
                t0 = time.perf_counter()
                resp = await http.post(
                    f"/sessions/{s['id']}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {s['api_key']}"},
                )
                latencies.append(time.perf_counter() - t0)
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]
                if warm:
                    return

        await client(0, warm=True)
        latencies.clear()
        tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
        return {"latencies": latencies, "tokens": tokens, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--database-url", help="store for the gateway (default: a temp SQLite file)")
    ap.add_argument("--model-size", default="test", choices=["test", "demo"])
    args = ap.parse_args()

    import torch

    from engines.tiny_model import tiny_model_dir

    model_dir = tiny_model_dir(size=args.model_size)
    d = asyncio.run(direct(model_dir, args.clients, args.requests, args.max_tokens))
    g = through_gateway(model_dir, args.clients, args.requests, args.max_tokens, args.database_url)
    rows = []
    for name, r in (("engine in-process", d), ("gateway over HTTP", g)):
        lat = [x * 1000 for x in r["latencies"]]
        rows.append(
            (
                name,
                _pct(lat, 0.5),
                _pct(lat, 0.99),
                statistics.mean(lat),
                r["tokens"] / r["wall"],
                len(lat) / r["wall"],
            )
        )
    store = "sqlite" if not args.database_url else args.database_url.split(":")[0]
    print(
        f"\nclients {args.clients} x {args.requests} requests, {args.max_tokens} tokens each, "
        f"model {args.model_size}, store {store}; torch {torch.__version__}, "
        f"{os.cpu_count()} cores\n"
    )
    print("| path | p50 ms | p99 ms | mean ms | tokens/s | requests/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, p50, p99, mean, tps, rps in rows:
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {mean:.1f} | {tps:.0f} | {rps:.1f} |")
    (_, dp50, dp99, _, dtps, _), (_, gp50, gp99, _, gtps, _) = rows
    print(
        f"\nadded latency: p50 {gp50 - dp50:+.1f} ms, p99 {gp99 - dp99:+.1f} ms; "
        f"throughput ratio gateway/direct: {gtps / dtps:.2f}"
    )


if __name__ == "__main__":
    main()
