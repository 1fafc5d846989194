"""Weight sync: one publish from the trainer to the engines, against the raw cost of its bytes.

    .venv/bin/python bench/bench_publish.py [--model tiny smollm2 DIR ...] [--repeats 3]
        [--bucket-mb 512]

For each model, in one run: a one-rank FSDP backend's weights (`trainer.weights.ShardedWeights`,
gathered bucket by bucket as the trainer publishes them) go to
- **disk**: `DiskPublisher` to a real `rlgateway serve` on the local engine (its own process):
  the safetensors files written (`save_shards`, also timed alone), then `POST /admin/weights`,
  which answers once the engine serves the new version. The raw cost beside it: the same bytes
  written to a new file and read back into tensors. The three take turns, each keeping its
  newest two versions as the publisher does, so the kernel's writeback of the earlier ones
  (the files outlive a publish) weighs on all alike; the first turn warms up;
- **collective**: `CollectivePublisher` to a real gateway on an SGLang server
  (`tests/support/fake_sglang.py`, which joins the weight group and receives every tensor into
  its model as SGLang does; gloo on CPU), the first publish forming the group. The raw cost
  beside it: the same bytes broadcast over a gloo group of two processes on this machine.
The table gives medians over `--repeats` publishes (the collective's first, which forms the group,
apart), the ratio to the raw cost and, by the same seconds per byte, a 7B-parameter model in
bf16 (14 GB; a measure of this machine's transport, not a prediction for a GPU cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BYTES_7B = 7e9 * 2
"""A 7B-parameter model's weights in bf16."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raw_disk(state: dict[str, torch.Tensor], path: Path) -> float:
    """Seconds to write every tensor's bytes into the new file `path` and read them back into
    new tensors."""
    start = time.perf_counter()
    with path.open("wb") as f:
        for t in state.values():
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    out = {}
    with path.open("rb") as f:
        for name, t in state.items():
            buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            f.readinto(memoryview(buf.numpy()))
            out[name] = buf.view(t.dtype).reshape(t.shape)
    return time.perf_counter() - start


def keep_newest(directory: Path, keep: int) -> None:
    """Deletes all but the newest `keep` of `directory`'s `v{N}` entries (as the publisher)."""
    for old in sorted(directory.glob("v*"), key=lambda p: int(p.name[1:]))[:-keep]:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()


def _raw_receiver(port: int, sizes: list[int], repeats: int) -> None:
    """Rank 1 of the raw broadcast: receives `repeats` passes of tensors of `sizes` bytes."""
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 1, 2, timeout)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(repeats):
        for b in bufs:
            group.broadcast([b], dist.BroadcastOptions()).wait()
        group.barrier().wait()


def raw_broadcast(state: dict[str, torch.Tensor], repeats: int) -> list[float]:
    """Seconds per pass of every tensor's bytes broadcast from this process to another over
    gloo (tensor by tensor, as the publisher sends them)."""
    import subprocess

    port = free_port()
    sizes = [t.numel() * t.element_size() for t in state.values()]
    spec = f"{port}:{repeats}:{','.join(map(str, sizes))}"
    peer = subprocess.Popen([sys.executable, __file__, "--raw-receiver", spec])
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=120)
    )
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=120))
    views = [t.contiguous().view(torch.uint8).reshape(-1) for t in state.values()]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for v in views:
            group.broadcast([v], dist.BroadcastOptions()).wait()
        group.barrier().wait()
        times.append(time.perf_counter() - start)
    peer.wait(timeout=60)
    return times


async def timed_publishes(publisher: Any, weights: Any, first: int, repeats: int) -> list[float]:
    times = []
    for v in range(first, first + repeats):
        times.append(await timed_publish(publisher, weights, v))
    return times


async def timed_publish(publisher: Any, weights: Any, version: int) -> float:
    start = time.perf_counter()
    served = await publisher.publish(weights, version)
    assert served == version, (served, version)
    return time.perf_counter() - start


def bench_model(name: str, repeats: int, bucket_bytes: int) -> dict[str, Any]:
    from engines.weights import save_shards
    from rlgateway.models import resolve_model
    from tests.support.fake_sglang import run_fake_sglang
    from tests.support.gateway_server import run_gateway
    from trainer.backends.fsdp import FSDPBackend
    from trainer.collective import AdminSink, CollectivePublisher
    from trainer.publish import DiskPublisher, GatewayAdmin
    from trainer.weights import ShardedWeights

    model_dir = resolve_model(name, Path.cwd())
    backend = FSDPBackend(model_dir)
    weights = ShardedWeights(backend)
    state = {k: v.detach().clone() for k, v in backend.full_state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"model": name, "bytes": size}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for sub in ("raw", "written", "disk-gw"):
            (tmp / sub).mkdir()
        out["raw_disk"], out["write"], out["disk"] = [], [], []
        with run_gateway(model_dir, tmp / "disk-gw", timeout=300) as gw:
            admin = GatewayAdmin(gw.url, gw.admin_token)
            disk = DiskPublisher(tmp / "published", model_dir, admin, bucket_bytes=bucket_bytes)
            # interleaved, each keeping its newest two versions as the publisher does, so that
            # the kernel's writeback of earlier versions weighs on all three alike
            for v in range(1, repeats + 2):
                raw = raw_disk(state, tmp / "raw" / f"v{v}")
                keep_newest(tmp / "raw", 2)
                start = time.perf_counter()
                save_shards(weights.buckets(bucket_bytes), tmp / "written" / f"v{v}", model_dir)
                write = time.perf_counter() - start
                keep_newest(tmp / "written", 2)
                publish = asyncio.run(timed_publish(disk, weights, v))
                if v > 1:  # the first of each warms up
                    out["raw_disk"].append(raw)
                    out["write"].append(write)
                    out["disk"].append(publish)
        out["raw_broadcast"] = raw_broadcast(state, repeats)
        (tmp / "group-gw").mkdir()
        with run_fake_sglang(model_dir, startup_s=300) as server:
            args = ["--engine", "sglang", "--engine-url", server.url]
            with run_gateway(model_dir, tmp / "group-gw", extra_args=args, timeout=300) as gw:
                admin = GatewayAdmin(gw.url, gw.admin_token)
                fallback = DiskPublisher(tmp / "fallback", model_dir, admin)
                group = CollectivePublisher(
                    AdminSink(admin),
                    fallback,
                    master_address="127.0.0.1",
                    bucket_bytes=bucket_bytes,
                    timeout_s=600,
                )
                times = asyncio.run(timed_publishes(group, weights, 1, repeats + 1))
                assert group.broadcasts == repeats + 1, "a version went from disk"
                out["group_first"], out["group"] = times[0], times[1:]
    weights.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny"], help="tiny, smollm2 or a directory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--raw-receiver", help=argparse.SUPPRESS)  # PORT:REPEATS:SIZES, the peer
    args = ap.parse_args()
    if args.raw_receiver:
        port, repeats, sizes = args.raw_receiver.split(":")
        _raw_receiver(int(port), [int(n) for n in sizes.split(",")], int(repeats))
        return
    os.environ.setdefault("RLGATEWAY_LOG_LEVEL", "warning")
    results = [bench_model(m, args.repeats, args.bucket_mb << 20) for m in args.model]
    print(
        f"\n{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} publishes each\n"
    )
    print("| model | MB | path | publish s | raw s | publish / raw | 7B bf16 by the same measure |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in results:
        mb = r["bytes"] / 2**20
        raw_d = statistics.median(r["raw_disk"])
        raw_b = statistics.median(r["raw_broadcast"])
        rows = (
            ("disk: write the files only", r["write"], raw_d),
            ("disk: write + gateway loads + serves", r["disk"], raw_d),
            ("collective: broadcast + servers load", r["group"], raw_b),
            ("collective: the first (forms the group)", [r["group_first"]], raw_b),
        )
        for label, times, raw in rows:
            t = statistics.median(times)
            seven = t / r["bytes"] * BYTES_7B
            print(
                f"| {r['model']} | {mb:,.0f} | {label} | {t:.2f} | {raw:.2f} | {t / raw:.2f}x "
                f"| {seven:,.0f} s |"
            )


if __name__ == "__main__":
    main()
