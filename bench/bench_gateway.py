"""Gateway overhead: the same chat requests straight to the local engine in-process, and through
`rlgateway serve` over HTTP (recorded into sessions in the store), side by side in one run.

    .venv/bin/python bench/bench_gateway.py [--clients 64] [--requests 4] [--max-tokens 32]
        [--database-url postgresql://...] [--gateway NAME=SERVE_ARGS ...] [--baseline DIR]
        [--repeat N]

Each of C concurrent clients sends R requests one after another; every request is a fresh
single-turn chat (its own session through the gateway) with the same seeds on both sides, so both
sides sample the same tokens. Latency is measured per request from send to the full response.
Prints a markdown table: p50/p99 latency, throughput, and the gateway's added latency and
throughput ratio. `--gateway` measures more than one gateway configuration in the same run (e.g.
`--gateway "engine process=" --gateway "in-process engine=--in-process-engine"`); `--repeat`
alternates direct and gateway runs N times and reports each row's median run (by throughput), as
the machine's other load comes and goes. The CPU seconds that the gateway process and its engine
process spent per request are reported too (Linux /proc), which other load does not inflate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def through_gateway(
    model_dir: Path,
    clients: int,
    requests: int,
    max_tokens: int,
    database_url: str | None,
    serve_args: list[str],
    checkout: str | None = None,
) -> dict[str, Any]:
    """`checkout`: run the gateway from that source tree (e.g. an earlier commit's export)."""
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    db = database_url or f"sqlite:///{tmp / 'bench.db'}"
    env = {**os.environ, "RLGATEWAY_ADMIN_TOKEN": ADMIN}
    if checkout:
        env["PYTHONPATH"] = checkout
    cmd = [
        sys.executable,
        "-m",
        "rlgateway.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--database-url",
        db,
        "--log-level",
        "warning",
        *serve_args,
    ]
    with open(tmp / "serve.log", "w") as log:
        # cwd too: `python -m` puts the working directory first on sys.path
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=checkout or None
        )
        try:
            base = f"http://127.0.0.1:{port}"
            return asyncio.run(_gateway_clients(base, tmp, clients, requests, max_tokens, proc))
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    """Until the gateway at `base` answers /health; RuntimeError if it exits or takes 2 min."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for _ in range(600):
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the gateway did not start; see {log}")


async def _gateway_clients(
    base: str,
    tmp: Path,
    clients: int,
    requests: int,
    max_tokens: int,
    proc: subprocess.Popen[bytes],
) -> dict[str, Any]:
    pid = proc.pid
    await wait_healthy(proc, base, tmp / "serve.log")
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
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
        host, port = base.removeprefix("http://").split(":")

        async def client(c: int, warm: bool = False) -> None:
            nonlocal tokens
            conn = _Conn(host, int(port))
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
                data = json.dumps(body).encode()
                t0 = time.perf_counter()
                status, out = await conn.post(
                    f"/sessions/{s['id']}/v1/chat/completions", data, s["api_key"]
                )
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"status {status}: {out[:500]!r}")
                tokens += json.loads(out)["usage"]["completion_tokens"]
                if warm:
                    break
            conn.close()

        await client(0, warm=True)
        latencies.clear()
        tokens = 0
        engines = _children(pid)
        cpu0 = [_cpu_seconds(p) for p in [pid, *engines]]
        client0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
        cpu = [_cpu_seconds(p) - c for p, c in zip([pid, *engines], cpu0, strict=True)]
        return {
            "latencies": latencies,
            "tokens": tokens,
            "wall": wall,
            "gateway_cpu": cpu[0],
            "engine_cpu": sum(cpu[1:]),
            "client_cpu": time.process_time() - client0,
        }


class _Conn:
    """A minimal HTTP/1.1 keep-alive connection: POST a JSON body, read a Content-Length response.
    The bench's client must cost little CPU, because on a small machine it competes with the
    server it measures: httpx spends about 5 ms of CPU per request here, this about 0.2 ms."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes, token: str) -> tuple[int, bytes]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(runs, key=lambda r: r["tokens"] / r["wall"])
    return ranked[len(ranked) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--database-url", help="store for the gateway (default: a temp SQLite file)")
    ap.add_argument("--model-size", default="test", choices=["test", "demo"])
    ap.add_argument("--model", help="smollm2 or a model directory instead of a tiny model")
    ap.add_argument(
        "--gateway",
        action="append",
        metavar="NAME=SERVE_ARGS",
        help="a gateway configuration to measure: a row name and extra `rlgateway serve` flags "
        "(repeatable; default one row, 'gateway over HTTP', with serve's defaults)",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure the gateway run from this source tree, e.g. an earlier commit: "
        "git archive COMMIT | tar -x -C DIR",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the median is shown")
    ap.add_argument(
        "--threads",
        type=int,
        help="torch threads of the engine on both sides (the direct engine's process, and the "
        "gateway's engine process via --engine-threads); default: torch's and serve's defaults",
    )
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from engines.tiny_model import tiny_model_dir

    variants = [
        (name, serve_args, None)
        for name, serve_args in (v.split("=", 1) for v in args.gateway or ["gateway over HTTP="])
    ]
    if args.baseline:
        variants.insert(0, (f"baseline {args.baseline}", "", args.baseline))
    if args.model:
        from rlgateway.models import resolve_model

        model_dir = resolve_model(args.model, Path.cwd())
    else:
        model_dir = tiny_model_dir(size=args.model_size)
    runs: dict[str, list[dict[str, Any]]] = {"engine in-process": []}
    for name, _, checkout in variants:
        runs[f"gateway, {name}" if args.gateway or checkout else name] = []
    threads = ["--engine-threads", str(args.threads)] if args.threads else []
    for _ in range(args.repeat):
        runs["engine in-process"].append(
            asyncio.run(direct(model_dir, args.clients, args.requests, args.max_tokens))
        )
        for (_name, serve_args, checkout), key in zip(variants, list(runs)[1:], strict=True):
            runs[key].append(
                through_gateway(
                    model_dir, args.clients, args.requests, args.max_tokens, args.database_url,
                    [*serve_args.split(), *threads], checkout,
                )
            )  # fmt: skip
    rows = []
    for name, rs in runs.items():
        r = _median_run(rs)
        lat = [x * 1000 for x in r["latencies"]]
        rows.append(
            (
                name,
                _pct(lat, 0.5),
                _pct(lat, 0.99),
                statistics.mean(lat),
                r["tokens"] / r["wall"],
                len(lat) / r["wall"],
                r,
            )
        )
    store = "sqlite" if not args.database_url else args.database_url.split(":")[0]
    print(
        f"\nclients {args.clients} x {args.requests} requests, {args.max_tokens} tokens each, "
        f"model {args.model or args.model_size}, store {store}; torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} engine threads\n"
    )
    print(
        "| path | p50 ms | p99 ms | mean ms | tokens/s | requests/s | added p50 ms | ratio "
        "| gateway CPU ms/req | engine-process CPU ms/req | client CPU ms/req |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    _, dp50, _, _, dtps, _, _ = rows[0]
    for name, p50, p99, mean, tps, rps, r in rows:
        n = len(r["latencies"])
        cpu = (
            f"{1000 * r['gateway_cpu'] / n:.2f} | {1000 * r['engine_cpu'] / n:.2f} "
            f"| {1000 * r['client_cpu'] / n:.2f}"
            if "gateway_cpu" in r
            else "- | - | -"
        )
        print(
            f"| {name} | {p50:.1f} | {p99:.1f} | {mean:.1f} | {tps:.0f} | {rps:.1f} "
            f"| {p50 - dp50:+.1f} | {tps / dtps:.2f} | {cpu} |"
        )
    print(f"\n{args.repeat} run(s) per row; each row shows its median run by throughput")


if __name__ == "__main__":
    main()
