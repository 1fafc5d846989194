"""Episodes and groups: a row becomes `group_size` sessions of one group, each runs the workflow
with a client bound to it, and its reward is posted and the session ended; or, when anything
failed, the session is ended as failed with the reason (never trained; its group is judged
without it). Nothing a workflow does can stop the experiment: every exception becomes a counted,
recorded failure.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai
from openai import AsyncOpenAI

from rlgateway.experiment.client import GatewayClient, SessionHandle
from rlgateway.experiment.rewards import RewardRunner
from rlgateway.experiment.workflows import (
    AgentFailed,
    Episode,
    EpisodeReturn,
    RewardFailed,
    Rewards,
    Row,
    Workflow,
)


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    session_id: str
    reward: float | None
    """The episode's return (final reward plus its turns' rewards, undiscounted); None if it
    failed."""
    failure: str | None = None
    seconds: float = 0.0


@dataclass(slots=True)
class Tally:
    """What the rollouts did, for the metrics rows."""

    episodes: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    """Failed episodes by kind: reward_error, reward_timeout, reward_invalid, agent, workflow,
    gateway."""
    rewards: list[float] = field(default_factory=list)

    def add(self, r: EpisodeResult, kind: str | None) -> None:
        self.episodes += 1
        if kind is not None:
            self.failures[kind] += 1
        elif r.reward is not None:
            self.rewards.append(r.reward)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    max_tokens: int | None
    evaluation: bool


class Rollouts:
    def __init__(
        self,
        client: GatewayClient,
        workflow: Workflow,
        reward: RewardRunner,
        *,
        model: str,
        tally: Tally | None = None,
    ) -> None:
        self.client = client
        self.workflow = workflow
        self.reward = reward
        self.model = model
        self.tally = tally if tally is not None else Tally()
        self._openai = AsyncOpenAI(
            base_url=f"{client.url}/v1", api_key="unused", timeout=600.0, max_retries=0
        )

    async def close(self) -> None:
        await self._openai.close()

    async def group(
        self,
        run_id: str,
        row: Row,
        *,
        size: int,
        group_id: str,
        metadata: dict[str, Any],
        sampling: Sampling | list[Sampling],
        stop: asyncio.Event | None = None,
    ) -> list[EpisodeResult] | None:
        """One group of `size` episodes on `row` (None if `stop` came before it was admitted).
        `sampling` may differ per member (an evaluation's greedy and sampled answers)."""
        handles = await self.client.sessions(
            run_id, size, group_id=group_id, metadata=metadata, stop=stop
        )
        if handles is None:
            return None
        per = sampling if isinstance(sampling, list) else [sampling] * size
        return list(
            await asyncio.gather(
                *(self.episode(h, row, s) for h, s in zip(handles, per, strict=False))
            )
        )

    async def episode(self, h: SessionHandle, row: Row, sampling: Sampling) -> EpisodeResult:
        t0 = time.perf_counter()
        client = self._openai.with_options(base_url=h.base_url, api_key=h.api_key)
        ep = Episode(
            session_id=h.id,
            model=self.model,
            base_url=h.base_url,
            api_key=h.api_key,
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            evaluation=sampling.evaluation,
            grade=self.reward,
        )
        kind: str | None = None
        try:
            got = await self.workflow.arun_episode(client, row, ep)
            value = await self._post(h, got)
            failure = None if value is not None else "the workflow returned no reward"
            kind = None if value is not None else "rejected"
        except RewardFailed as exc:
            value, failure, kind = None, str(exc), f"reward_{exc.outcome.status}"
        except AgentFailed as exc:
            value, failure, kind = None, str(exc), "agent"
        except openai.APIError as exc:
            value, failure, kind = None, f"a request failed: {exc}", "gateway"
        except Exception as exc:
            value, failure, kind = (
                None,
                f"the workflow raised {type(exc).__name__}: {exc}",
                "workflow",
            )
        if failure is None:
            await self.client.end(h.id)
        else:
            await self.client.end(h.id, failure=failure)
        result = EpisodeResult(h.id, value, failure, time.perf_counter() - t0)
        self.tally.add(result, kind)
        return result

    async def _post(self, h: SessionHandle, got: EpisodeReturn) -> float | None:
        """Post what the workflow returned; its total, or None when it rejected the sample."""
        if got is None:
            return None
        rewards = got if isinstance(got, Rewards) else Rewards(final=float(got))
        values = [*rewards.turns.values()] + ([rewards.final] if rewards.final is not None else [])
        if not values:
            return None
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"the workflow returned a non-finite reward: {values}")
        for completion_id, v in rewards.turns.items():
            await self.client.reward(h.id, float(v), completion_id)
        if rewards.final is not None:
            await self.client.reward(h.id, float(rewards.final))
        return float(sum(values))
