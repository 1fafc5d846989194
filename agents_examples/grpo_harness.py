"""Run a dataset of tasks as GRPO groups against any rlgateway and post the grader's rewards.

For each task it creates `--group-size` sessions with one `group_id` (the trainer baselines
rewards within a group), lets one agent answer in each session through the session's own base_url
and key, grades the answer and posts the reward, then ends the session. When the gateway's
staleness control answers 429, it waits as long as Retry-After says and asks again.

    export RLGATEWAY_API_KEY=rlr-...    # the run's key (from POST /runs), or the admin token
    python agents_examples/grpo_harness.py --gateway http://127.0.0.1:8000 --run RUN_ID \
        --dataset tasks.jsonl --group-size 8 --concurrency 4

`tasks.jsonl` holds one {"prompt": ..., "answer": ...} per line (without --dataset: a few
built-in "largest of four digits" tasks). Without --run a new run is created (that needs the
admin token). Prints one JSON line per group and a final summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI


def builtin_tasks(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        digits = rng.sample(range(10), 4)
        prompt = "Largest of " + " ".join(map(str, digits)) + "?"
        tasks.append({"prompt": prompt, "answer": str(max(digits))})
    return tasks


def grade(answer: str, reply: str) -> float:
    return 1.0 if reply.strip() == answer.strip() else 0.0


class Harness:
    def __init__(self, gateway: str, admin_token: str, run_id: str, args: argparse.Namespace):
        self.http = httpx.AsyncClient(
            base_url=gateway.rstrip("/"),
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=120,
        )
        self.openai = AsyncOpenAI(base_url=f"{gateway.rstrip('/')}/v1", api_key="unused")
        self.run_id = run_id
        self.args = args

    async def sessions(self, task: dict[str, str], group_id: str) -> list[dict[str, Any]]:
        body = {"count": self.args.group_size, "group_id": group_id, "metadata": task}
        while True:
            r = await self.http.post(f"/runs/{self.run_id}/sessions", json=body)
            if r.status_code != 429:
                r.raise_for_status()
                return list(r.json()["sessions"])
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))

    async def episode(self, session: dict[str, Any], task: dict[str, str]) -> float:
        client = self.openai.with_options(base_url=session["base_url"], api_key=session["api_key"])
        reply = await client.chat.completions.create(
            model=self.args.model,
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=self.args.max_tokens,
            temperature=1.0,
        )
        reward = grade(task["answer"], reply.choices[0].message.content or "")
        auth = {"Authorization": f"Bearer {session['api_key']}"}
        url = f"/sessions/{session['id']}"
        (
            await self.http.post(f"{url}/reward", json={"reward": reward}, headers=auth)
        ).raise_for_status()
        (await self.http.post(f"{url}/end", headers=auth)).raise_for_status()
        return reward

    async def group(self, i: int, task: dict[str, str]) -> list[float]:
        sessions = await self.sessions(task, group_id=f"task-{i}")
        rewards = await asyncio.gather(*(self.episode(s, task) for s in sessions))
        print(json.dumps({"group": f"task-{i}", "prompt": task["prompt"], "rewards": rewards}))
        return list(rewards)


async def amain(args: argparse.Namespace, tasks: list[dict[str, str]]) -> None:
    token = (
        args.key or os.environ.get("RLGATEWAY_API_KEY") or os.environ.get("RLGATEWAY_ADMIN_TOKEN")
    )
    if not token:
        raise SystemExit(
            "set RLGATEWAY_API_KEY to the run's key (or --key): creating sessions needs it"
        )
    run_id = args.run
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        if run_id is None:
            r = await http.post(f"{args.gateway.rstrip('/')}/runs", json={"name": "grpo-harness"})
            r.raise_for_status()
            run_id = r.json()["id"]
    harness = Harness(args.gateway, token, run_id, args)
    gate = asyncio.Semaphore(args.concurrency)

    async def limited(i: int, task: dict[str, str]) -> list[float]:
        async with gate:
            return await harness.group(i, task)

    results = await asyncio.gather(*(limited(i, t) for i, t in enumerate(tasks)))
    rewards = [r for group in results for r in group]
    print(
        json.dumps(
            {"run": run_id, "groups": len(results), "mean_reward": sum(rewards) / len(rewards)}
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--key", help="the run's key or the admin token (default: RLGATEWAY_API_KEY)")
    p.add_argument("--run", help="the run to add sessions to (default: a new run)")
    p.add_argument("--dataset", help="JSONL of {prompt, answer} (default: built-in tasks)")
    p.add_argument("--tasks", type=int, default=8, help="built-in tasks to make (default 8)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight at once")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default="demo")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.dataset:
        lines = Path(args.dataset).read_text().splitlines()
        tasks = [json.loads(line) for line in lines if line.strip()]
    else:
        tasks = builtin_tasks(args.tasks, args.seed)
    asyncio.run(amain(args, tasks))


if __name__ == "__main__":
    main()
