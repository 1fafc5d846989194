"""The demo's agents: many concurrent single-turn agents built on the `openai` SDK, run as GRPO
groups against the gateway over HTTP, graded in code, rewarded over HTTP.

Each worker loops: create a group of `group_size` sessions for one problem (`POST
/runs/{id}/sessions`, waiting while the gateway's admission control answers 429), let one agent
answer in each session through the session's own `base_url` and key, grade the answer, post the
reward and end the session. Only public HTTP is used, exactly what a user's harness would do
(`agents_examples/grpo_harness.py` is the standalone version).

The demo runs them as a program of their own (`python -m rlgateway.demo.harness`, see `main`),
as a user's agents are: they do not share the gateway's interpreter (its lock, its event loop)
with it and the trainer. Each finished episode is one JSON line on stdout; SIGTERM (or stdin
closing) stops them after the groups already started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from openai import AsyncOpenAI

from rlgateway.demo.task import MAX_TOKENS, Problem, grade

RETRY_SECONDS = 0.05
"""How soon a worker asks again after a 429 (the trainer publishes often; Retry-After is 1 s)."""


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished, rewarded session, as the agent side saw it."""

    t: float
    """Seconds since the harness started, when the reward was posted."""
    reward: float
    version: int
    """The policy version serving when the answer came back."""
    completion_tokens: int
    problem_id: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Episode:
        return cls(**json.loads(line))


async def answer(client: AsyncOpenAI, model: str, problem: Problem) -> tuple[str, int]:
    """The agent: one chat completion, sampled at temperature 1. Returns (text, tokens)."""
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": problem.prompt}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    tokens = reply.usage.completion_tokens if reply.usage is not None else 0
    return reply.choices[0].message.content or "", tokens


class Agents:
    def __init__(
        self,
        *,
        gateway_url: str,
        admin_token: str,
        run_id: str,
        model: str,
        problems: list[Problem],
        group_size: int,
        workers: int,
        seed: int,
        version: Callable[[], int],
        on_episode: Callable[[Episode], None],
    ) -> None:
        self.url = gateway_url.rstrip("/")
        self.run_id = run_id
        self.model = model
        self.problems = problems
        self.group_size = group_size
        self.workers = workers
        self.seed = seed
        self.version = version
        self.on_episode = on_episode
        self.rejected = 0
        self._admin = {"Authorization": f"Bearer {admin_token}"}
        self._t0 = time.perf_counter()

    async def run(self, stop: asyncio.Event) -> None:
        """Run workers until `stop` is set; groups already started are finished."""
        limits = httpx.Limits(max_connections=self.workers * self.group_size + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            openai = AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120)
            self._t0 = time.perf_counter()
            await asyncio.gather(
                *(self._worker(w, http, openai, stop) for w in range(self.workers))
            )

    async def _worker(
        self, w: int, http: httpx.AsyncClient, openai: AsyncOpenAI, stop: asyncio.Event
    ) -> None:
        rng = random.Random(self.seed * 1_000_003 + w)
        g = 0
        while not stop.is_set():
            problem = rng.choice(self.problems)
            sessions = await self._group(http, problem, f"w{w}-g{g}-{problem.id}", stop)
            if sessions is None:
                return
            g += 1
            await asyncio.gather(*(self._episode(http, openai, s, problem) for s in sessions))

    async def _group(
        self, http: httpx.AsyncClient, problem: Problem, group_id: str, stop: asyncio.Event
    ) -> list[dict[str, Any]] | None:
        body = {
            "count": self.group_size,
            "group_id": group_id,
            "metadata": {"task": problem.prompt, "length": problem.length},
        }
        while not stop.is_set():
            r = await http.post(f"/runs/{self.run_id}/sessions", json=body, headers=self._admin)
            if r.status_code == 429:
                self.rejected += 1
                await asyncio.sleep(RETRY_SECONDS)
                continue
            r.raise_for_status()
            sessions: list[dict[str, Any]] = r.json()["sessions"]
            return sessions
        return None

    async def _episode(
        self, http: httpx.AsyncClient, openai: AsyncOpenAI, s: dict[str, Any], problem: Problem
    ) -> None:
        client = openai.with_options(base_url=s["base_url"], api_key=s["api_key"])
        text, tokens = await answer(client, self.model, problem)
        version = self.version()
        reward = grade(problem, text)
        key = {"Authorization": f"Bearer {s['api_key']}"}
        r = await http.post(f"/sessions/{s['id']}/reward", json={"reward": reward}, headers=key)
        r.raise_for_status()
        (await http.post(f"/sessions/{s['id']}/end", headers=key)).raise_for_status()
        t = time.perf_counter() - self._t0
        self.on_episode(Episode(t, reward, version, tokens, problem.id))


ADMIN_TOKEN_ENV = "RLGATEWAY_DEMO_ADMIN_TOKEN"
"""The admin token reaches the agents' process in its environment, not on its command line."""


def main(argv: list[str] | None = None) -> int:
    """The agents as a program: `python -m rlgateway.demo.harness --url URL --run RUN ...`, the
    admin token in `$RLGATEWAY_DEMO_ADMIN_TOKEN`. Prints each episode as a JSON line (version -1:
    the process that reads them knows which version serves) and runs until SIGTERM or EOF on
    stdin."""
    from rlgateway.demo.task import all_problems

    p = argparse.ArgumentParser(prog="python -m rlgateway.demo.harness")
    p.add_argument("--url", required=True, help="the gateway's base URL")
    p.add_argument("--run", required=True, help="the run the sessions belong to")
    p.add_argument("--model", default="demo", help="the served model name")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    token = os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        p.error(f"${ADMIN_TOKEN_ENV} must hold the gateway's admin token")

    def emit(ep: Episode) -> None:
        sys.stdout.write(ep.to_json() + "\n")
        sys.stdout.flush()

    agents = Agents(
        gateway_url=args.url,
        admin_token=token,
        run_id=args.run,
        model=args.model,
        problems=all_problems(),
        group_size=args.group_size,
        workers=args.workers,
        seed=args.seed,
        version=lambda: -1,
        on_episode=emit,
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        fd = sys.stdin.fileno()

        def on_stdin() -> None:
            if not os.read(fd, 4096):  # EOF: whoever started us is gone
                loop.remove_reader(fd)
                stop.set()

        with contextlib.suppress(NotImplementedError, OSError, ValueError):
            loop.add_reader(fd, on_stdin)
        await agents.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
