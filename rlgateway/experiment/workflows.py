"""Workflows: the logic of one episode, in AReaL's `arun_episode` shape, run through the gateway.

A workflow is given an OpenAI-compatible client bound to a fresh session of its group (every
request it makes is recorded token-exact, as an outside agent's would be), the data row, and an
`Episode` (the sampling settings, whether this is an evaluation, and the experiment's grader). It
returns the episode's reward:

- a number: the episode's final reward;
- `Rewards(final=..., turns={completion_id: reward})`: per-turn rewards (credited at their turn,
  discounted by the run's `discount`), and optionally a final one;
- `None`: the workflow rejects the sample (the session is ended as failed, never trained).

A grader that raises or times out (`RewardFailed`), an agent program that crashes
(`AgentFailed`) or any other exception ends the session as failed with the reason; the
experiment counts it and goes on. Built in: `SingleTurn`, `MultiTurn` (the environment answers
a wrong answer with feedback, up to `max_turns`), and `AgentProgram` (any program, run as a
subprocess with `OPENAI_BASE_URL`/`OPENAI_API_KEY` set to its session). A custom workflow is any
object with `async arun_episode(client, row, episode)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from openai import AsyncOpenAI

from rlgateway.experiment.rewards import RewardOutcome

Row = dict[str, Any]
Grade = Callable[[str, str, Row], Awaitable[RewardOutcome]]


@dataclass(frozen=True, slots=True)
class Episode:
    """What a workflow gets besides its client and row."""

    session_id: str
    model: str
    """The served model name, for `client.chat.completions.create(model=...)`."""
    base_url: str
    """The session's OpenAI base URL (ends in /v1); `client` already uses it."""
    api_key: str
    """The session's key; `client` already uses it."""
    temperature: float
    """0 for a greedy evaluation; the run's sampling temperature otherwise."""
    max_tokens: int | None
    evaluation: bool
    grade: Grade
    """The experiment's reward function, run off the event loop under its timeout."""


@dataclass(frozen=True, slots=True)
class Rewards:
    """Per-turn rewards keyed by the turn's completion id (`reply.id`), and a final reward."""

    final: float | None = None
    turns: dict[str, float] = field(default_factory=dict)


EpisodeReturn = float | int | bool | Rewards | None


class RewardFailed(Exception):
    """The grader did not give a number: it raised, timed out, or returned something else."""

    def __init__(self, outcome: RewardOutcome) -> None:
        super().__init__(f"reward {outcome.status}: {outcome.detail}")
        self.outcome = outcome


class AgentFailed(Exception):
    """An agent program exited non-zero, timed out, or printed no answer."""


class Workflow(Protocol):
    async def arun_episode(
        self, client: AsyncOpenAI, row: Row, episode: Episode
    ) -> EpisodeReturn: ...


async def graded(episode: Episode, prompt: str, completion: str, row: Row) -> float:
    """The grader's value, or `RewardFailed`."""
    outcome = await episode.grade(prompt, completion, row)
    if outcome.value is None:
        raise RewardFailed(outcome)
    return outcome.value


def render(template: str, row: Row) -> str:
    """`template` with `{field}` replaced by the row's values; a missing field is a KeyError
    naming it (checked on the first rows before anything starts)."""
    return template.format_map(row)


def first_messages(system: str | None, user: str) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]


@dataclass(frozen=True, slots=True)
class SingleTurn:
    """One question, one answer, graded."""

    prompt: str = "{prompt}"
    """The user message: a template over the row's fields."""
    system: str | None = None

    async def arun_episode(self, client: AsyncOpenAI, row: Row, episode: Episode) -> float:
        user = render(self.prompt, row)
        reply = await client.chat.completions.create(
            model=episode.model,
            messages=first_messages(self.system, user),  # type: ignore[arg-type]
            temperature=episode.temperature,
            max_tokens=episode.max_tokens,
        )
        return await graded(episode, user, reply.choices[0].message.content or "", row)


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Answer, hear the environment, answer again: a wrong answer (reward below `solved`) is
    answered with `feedback` and the model tries again, up to `max_turns` answers. The reward
    is credited at the turn that solved it, so the run's per-turn `discount` makes a first-turn
    solution worth more than a third-turn one."""

    prompt: str = "{prompt}"
    system: str | None = None
    feedback: str = "That is not right. Try again."
    """The environment's reply to a wrong answer: a template over the row's fields and
    `{turn}` (the answer just given, from 1)."""
    max_turns: int = 3
    solved: float = 1.0
    """A turn whose reward reaches this ends the episode."""

    async def arun_episode(self, client: AsyncOpenAI, row: Row, episode: Episode) -> Rewards:
        user = render(self.prompt, row)
        messages = first_messages(self.system, user)
        for turn in range(1, self.max_turns + 1):
            reply = await client.chat.completions.create(
                model=episode.model,
                messages=messages,  # type: ignore[arg-type]
                temperature=episode.temperature,
                max_tokens=episode.max_tokens,
            )
            text = reply.choices[0].message.content or ""
            value = await graded(episode, user, text, row)
            if value >= self.solved:
                return Rewards(turns={reply.id: value})
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": render(self.feedback, {**row, "turn": turn})},
            ]
        return Rewards(final=0.0)


@dataclass(frozen=True, slots=True)
class AgentProgram:
    """Any agent program, run as a subprocess bound to its session: `OPENAI_BASE_URL`,
    `OPENAI_API_KEY` (and `ANTHROPIC_BASE_URL`/`ANTHROPIC_API_KEY` for Anthropic SDKs),
    `RLGATEWAY_MODEL`, `RLGATEWAY_TEMPERATURE` and `RLGATEWAY_MAX_TOKENS` in its environment, the
    row as JSON on stdin. Its answer is its standard output: the last line, when it is a JSON
    object with `reward` (a number), is the reward; otherwise the whole output is the completion
    the experiment's grader grades. A non-zero exit, a timeout (the process group is killed) or
    an empty output is `AgentFailed`."""

    command: tuple[str, ...]
    timeout: float = 300.0
    prompt: str = "{prompt}"
    """What the grader sees as the prompt."""
    env: Mapping[str, str] = field(default_factory=dict)

    async def arun_episode(self, client: AsyncOpenAI, row: Row, episode: Episode) -> float:
        env = {
            **os.environ,
            **self.env,
            "OPENAI_BASE_URL": episode.base_url,
            "OPENAI_API_KEY": episode.api_key,
            "ANTHROPIC_BASE_URL": episode.base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": episode.api_key,
            "RLGATEWAY_MODEL": episode.model,
            "RLGATEWAY_TEMPERATURE": repr(episode.temperature),
            "RLGATEWAY_MAX_TOKENS": str(episode.max_tokens or ""),
        }
        proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills its children too
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(json.dumps(row).encode()), self.timeout
            )
        except TimeoutError:
            _kill_group(proc)
            await proc.wait()
            raise AgentFailed(f"the agent timed out after {self.timeout:g} s") from None
        except BaseException:
            _kill_group(proc)
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-400:]
            raise AgentFailed(f"the agent exited with status {proc.returncode}: {tail}")
        text = out.decode(errors="replace").strip()
        if not text:
            raise AgentFailed("the agent printed no answer")
        last = text.splitlines()[-1]
        reward = _reward_line(last)
        if reward is not None:
            return reward
        return await graded(episode, render(self.prompt, row), text, row)


def _reward_line(line: str) -> float | None:
    if not line.startswith("{"):
        return None
    with contextlib.suppress(ValueError):
        obj = json.loads(line)
        value = obj.get("reward") if isinstance(obj, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def python_command(path: str) -> tuple[str, ...]:
    """A Python agent file run with this interpreter."""
    return (sys.executable, path)
