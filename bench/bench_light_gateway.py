"""A gateway replica's weight: start time and resident memory of `rlgateway serve` on remote
engines (no torch, no transformers) side by side with the embedded engine, and what importing
torch and transformers costs by itself.

    .venv/bin/python bench/bench_light_gateway.py [--model DIR] [--repeats 3] [--turns 20]

Start time is from launching the process to its first `/health` 200 (polled every 20 ms, a
fresh SQLite store, the modules' bytecode written as an installed package has it); memory is
the gateway process's resident set (VmRSS, its engine process not counted) after start and
after `--turns` chat turns of one session. The remote engine is the fake SGLang server of the
tests (its own process, which imports torch; the gateway does not), on `--model` (default the
tiny model).
Prints one table of medians; tests/integration/deployment/test_light_gateway.py asserts the
imports, nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # for tests/support (the gateway process, the fake server)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@contextmanager
def serve(model: Path, engine_args: list[str], tmp: Path) -> Iterator[tuple[str, int, float]]:
    """`rlgateway serve` as a user starts it; yields (url, pid, seconds until /health said 200,
    polled every 20 ms)."""
    from tests.support.gateway_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rlgateway.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--database-url", f"sqlite:///{tmp / 'gateway.db'}"]
    cmd += ["--admin-token", "bench", "--model", str(model), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode
    t0 = time.perf_counter()
    with (tmp / "gateway.log").open("wb") as log:
        proc = subprocess.Popen(cmd + engine_args, stdout=log, stderr=log, env=env)
    try:
        while True:
            assert proc.poll() is None, (tmp / "gateway.log").read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.02)
        yield url, proc.pid, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def one(model: Path, engine_args: list[str], turns: int) -> tuple[float, float, float]:
    """(seconds to healthy, MB after start, MB after the turns) of one `serve`."""
    with tempfile.TemporaryDirectory() as tmp, serve(model, engine_args, Path(tmp)) as started:
        url, pid, seconds = started
        at_start = rss_mb(pid)
        with httpx.Client(base_url=url, timeout=120) as http:
            admin = {"Authorization": "Bearer bench"}
            run = http.post("/runs", json={"name": "light", "config": {}}, headers=admin)
            r = http.post(f"/runs/{run.json()['id']}/sessions", json={"count": 1}, headers=admin)
            s = r.json()["sessions"][0]
            key = {"Authorization": f"Bearer {s['api_key']}"}
            messages: list[dict[str, str]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"turn {turn}"})
                body = {"model": "m", "messages": messages[-6:], "max_tokens": 8}
                r = http.post(f"{s['base_url']}/chat/completions", json=body, headers=key)
                r.raise_for_status()
                reply = r.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
        return seconds, at_start, rss_mb(pid)


def imports_alone() -> tuple[float, float]:
    """(seconds, MB) of a Python that imports torch and transformers' tokenizer classes."""
    code = (
        "import time, resource; t = time.perf_counter(); import torch, transformers;"
        " from transformers import AutoTokenizer, PreTrainedTokenizerFast;"
        " print(time.perf_counter() - t,"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, mb = out.stdout.split()
    return float(seconds), float(mb)


def main() -> None:
    from engines.tiny_model import tiny_model_dir
    from tests.support.fake_sglang import run_fake_sglang

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    model = args.model or tiny_model_dir(size="test", seed=0)

    rows: list[tuple[str, list[tuple[float, float, float]]]] = []
    with run_fake_sglang(model) as server:
        remote = ["--engine", "sglang", "--engine-url", server.url]
        modes = {
            "remote engine (sglang)": remote,
            "embedded engine, own process": [],
            "embedded engine, in process": ["--in-process-engine"],
        }
        results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for _ in range(args.repeats):  # interleaved: the machine's noise falls on every mode
            for mode, extra in modes.items():
                results[mode].append(one(model, extra, args.turns))
        rows = list(results.items())
    imports = [imports_alone() for _ in range(args.repeats)]

    print(f"model {model.name}, {args.repeats} starts each, {args.turns} turns; medians")
    print("| gateway | start to healthy (s) | RSS after start (MB) | RSS after turns (MB) |")
    print("|---|---|---|---|")
    for mode, runs in rows:
        cols = [statistics.median(r[k] for r in runs) for k in range(3)]
        print(f"| {mode} | {cols[0]:.2f} | {cols[1]:.0f} | {cols[2]:.0f} |")
    seconds = statistics.median(s for s, _ in imports)
    mb = statistics.median(m for _, m in imports)
    print(
        f"| `import torch, transformers` alone | {seconds:.2f} (import only) | {mb:.0f} (peak) | |"
    )


if __name__ == "__main__":
    main()
