"""Asynchronous vs synchronous RL: wall-clock to a fixed number of training steps, eta = 0 against
2, 4 and 8, side by side in one run, on a workload with long-tailed generation lengths, and the
reward each run reached (a faster run that learns less is no win).

    .venv/bin/python bench/bench_async.py [--steps 30] [--etas 0 2 4 8] [--model tiny|smollm2|DIR]

Everything is real, as `rlgateway serve --train` runs it: agents call the gateway (SQLite
store) over ASGI, the local engine in its own process (`--in-process-engine`: in this one), a
grader posts rewards, the trainer (FSDP backend, GRPO) claims trajectories under the staleness
bound and hot-swaps weights into the engine. Each episode asks for a length drawn from a
long-tailed distribution (most answers short, a few 8-16x longer, forced with ignore_eos), which
is what makes synchronous RL wait for its slowest rollout. With eta = 0 the gateway admits one
batch per policy version; with eta > 0 agents keep generating for the next versions while the
trainer trains. The reward is learnable: the share of the reply's characters that are lowercase
ASCII letters; the table shows each run's mean reward over its first and its last five steps,
and how much of the wall-clock the trainer was busy (the rest it waited for a batch).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ADMIN = {"Authorization": "Bearer bench"}


def lowercase_share(text: str) -> float:
    """The reward: the share of `text`'s characters that are lowercase ASCII letters."""
    return sum("a" <= ch <= "z" for ch in text) / len(text) if text else 0.0


async def run_once(
    model: Path,
    eta: int,
    steps: int,
    batch: int,
    group: int,
    agents: int,
    seed: int,
    lr: float,
    engine_process: bool,
) -> dict[str, Any]:
    from engines.local import LocalEngine, LocalEngineConfig
    from engines.process import ProcessEngine
    from engines.tiny_model import load_tokenizer
    from gateway.deps import Components
    from gateway.settings import GatewaySettings
    from rlgateway.app import create_app
    from store import Store
    from trainer.backends.registry import build_backend
    from trainer.config import TrainConfig
    from trainer.loop import Trainer
    from trainer.publish import LocalPublisher

    tmp = Path(tempfile.mkdtemp(prefix=f"bench-async-eta{eta}-"))
    config = LocalEngineConfig(model=str(model))
    engine = ProcessEngine.load(config) if engine_process else LocalEngine.load(config)
    store = await Store.connect(f"sqlite:///{tmp / 'store.db'}")
    components = Components(engine, store, load_tokenizer(model), engine.eos_token_ids, model.name)
    app = create_app(GatewaySettings(admin_token="bench"), components)
    rng = random.Random(seed)
    run_config = {"eta": eta, "batch_size": batch, "group_size": group}
    generated = 0
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=600) as http:  # fmt: skip
                run = (await http.post("/runs", json={"name": "b", "config": run_config},
                                       headers=ADMIN)).json()  # fmt: skip
                cfg = TrainConfig.model_validate({
                    "run": run["id"], "database_url": "sqlite:///unused",
                    "checkpoint_dir": str(tmp / "ckpt"), "tensorboard": False,
                    "max_steps": steps, "optim": {"lr": lr, "seed": seed}, "keep_checkpoints": 1,
                    **run_config,
                })  # fmt: skip
                backend = build_backend(cfg.backend_config(str(model)))
                rows: list[dict[str, Any]] = []
                trainer = Trainer(cfg, store, backend, LocalPublisher(engine), report=rows.append)

                async def episode(s: dict[str, Any], length: int) -> None:
                    nonlocal generated
                    key = {"Authorization": f"Bearer {s['api_key']}"}
                    body = {"messages": [{"role": "user", "content": "go"}],
                            "max_tokens": length, "ignore_eos": True}  # fmt: skip
                    r = await http.post(f"/sessions/{s['id']}/v1/chat/completions", json=body,
                                        headers=key)  # fmt: skip
                    out = r.json()
                    generated += out["usage"]["completion_tokens"]
                    reward = lowercase_share(out["choices"][0]["message"]["content"] or "")
                    await http.post(f"/sessions/{s['id']}/reward", json={"reward": reward},
                                    headers=key)  # fmt: skip
                    await http.post(f"/sessions/{s['id']}/end", headers=key)

                async def agent(a: int) -> None:
                    g = 0
                    while engine.version() < steps:
                        r = await http.post(f"/runs/{run['id']}/sessions",
                                            json={"count": group, "group_id": f"{a}-{g}"},
                                            headers=ADMIN)  # fmt: skip
                        if r.status_code == 429:
                            await asyncio.sleep(0.05)
                            continue
                        g += 1
                        lengths = [16 if rng.random() < 0.85 else rng.choice([128, 256])
                                   for _ in range(group)]  # fmt: skip
                        await asyncio.gather(
                            *(
                                episode(s, n)
                                for s, n in zip(r.json()["sessions"], lengths, strict=True)
                            )
                        )

                t0 = time.perf_counter()
                workers = [asyncio.create_task(agent(a)) for a in range(agents)]
                await trainer.run()
                wall = time.perf_counter() - t0
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
    finally:
        await engine.close()
        await store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "eta": eta,
        "wall": wall,
        "generated": generated,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "train_s": sum(r["step_seconds"] for r in rows),
        "reward_first": statistics.fmean(r["reward_mean"] for r in rows[:5]),
        "reward_last": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--agents", type=int, default=8, help="concurrent agent loops (one group each)")
    ap.add_argument("--model", default="tiny", help="tiny (the test model), smollm2 or a directory")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-process-engine", action="store_true", help="the engine in this process")
    args = ap.parse_args()
    from rlgateway.models import resolve_model

    model = resolve_model(args.model, Path.cwd())
    results = [
        asyncio.run(
            run_once(
                model,
                eta,
                args.steps,
                args.batch,
                args.group,
                args.agents,
                args.seed,
                args.lr,
                not args.in_process_engine,
            )
        )
        for eta in args.etas
    ]
    print(
        f"\n{args.steps} steps x {args.batch} trajectories (groups of {args.group}), "
        f"{args.agents} agent loops, lengths 16 (85%) or 128/256 tokens; model {args.model}, "
        f"lr {args.lr}, the engine in {'this' if args.in_process_engine else 'its own'} process, "
        f"{os.cpu_count()} cores\n"
    )
    print(
        "| eta | wall s | steps/min | speedup over the first | trainer busy | tokens generated "
        "| staleness max | staleness mean | reward, first 5 steps | reward, last 5 steps |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = results[0]["wall"]
    for r in results:
        print(
            f"| {r['eta']} | {r['wall']:.1f} | {60 * args.steps / r['wall']:.1f} | "
            f"{base / r['wall']:.2f}x | {r['train_s'] / r['wall']:.0%} | {r['generated']} | "
            f"{r['staleness_max']} | "
            f"{r['staleness_mean']:.2f} | {r['reward_first']:.3f} | {r['reward_last']:.3f} |"
        )


if __name__ == "__main__":
    main()
