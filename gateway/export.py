"""The JSONL export of a run's trajectories (`GET /runs/{id}/export`), for SFT or offline RL.

One JSON object per line, one line per session, oldest session first. Schema
`rlgateway.trajectory.v1`:

    schema          "rlgateway.trajectory.v1"
    run_id, session_id, group_id, metadata, status ("active"|"ended"), train_state,
    created_at, ended_at (ISO 8601 UTC), prefix_breaks
    reward          the sum of the session's rewards, or null when it has none
    rewards         [{reward, completion_id (null: final), key, created_at}]
    returns         {completion_id: discounted return G_i} (gamma = the run's `discount`)
    segments        one training sequence each:
      index         its position in the session
      messages, tools   the chat transcript the segment ends with (OpenAI message dicts;
                    empty for raw /v1/completions segments)
      tokens        token ids, prompt and sampled, exactly as the engine saw them
      loss_mask     1 on sampled tokens, 0 on prompt, tool and other context tokens
      logprobs      behaviour logprob of each sampled token (0 elsewhere)
      versions      policy version that sampled each token (-1 elsewhere)
      completion_ids, turn_spans   each turn's id and its [start, end) of sampled tokens
      turn_returns  the return of each turn, aligned with completion_ids
      turn_sampling the sampling settings of each turn, aligned with completion_ids (its
                    `json_schema` or `grammar` when the reply was held to one: those
                    logprobs are the masked distribution's, `store.run_config`,
                    "Constrained turns")

`tokens`, `loss_mask`, `logprobs` and `versions` always share one length. For SFT keep the
tokens and train on `loss_mask`; for offline RL use `logprobs` as the behaviour policy and
`turn_returns` (or `reward`) as the signal.

Every line is strict JSON: numbers are finite (rewards are bounded, so their sums are too), and a
value that is not (a row written before the bound) stops the export with an error rather than
writing `Infinity` or `NaN`, which no JSON parser need accept.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.views import reward_json
from store import Store
from store.types import JSON, SessionDetail, SessionFilter

SCHEMA = "rlgateway.trajectory.v1"


def trajectory_line(d: SessionDetail, transcripts: dict[str, JSON]) -> dict[str, Any]:
    info = d.info
    return {
        "schema": SCHEMA,
        "run_id": info.run_id,
        "session_id": info.id,
        "group_id": info.group_id,
        "metadata": info.metadata,
        "status": info.status.value,
        "train_state": info.train_state.value,
        "created_at": info.created_at.isoformat(),
        "ended_at": info.ended_at.isoformat() if info.ended_at else None,
        "prefix_breaks": info.prefix_breaks,
        "reward": sum(r.value for r in d.rewards) if d.rewards else None,
        "rewards": [reward_json(r) for r in d.rewards],
        "returns": d.returns,
        "segments": [
            {
                "index": s.index,
                "messages": transcripts.get(s.id, {}).get("messages", []),
                "tools": transcripts.get(s.id, {}).get("tools", []),
                "tokens": s.tokens,
                "loss_mask": s.loss_mask,
                "logprobs": s.logprobs,
                "versions": s.versions,
                "completion_ids": s.completion_ids,
                "turn_spans": [list(span) for span in s.turn_spans],
                "turn_returns": [d.returns.get(c) for c in s.completion_ids],
                "turn_sampling": s.turn_sampling,
            }
            for s in d.segments
        ],
    }


async def jsonl(
    store: Store, run_id: str, where: SessionFilter, gamma: float
) -> AsyncIterator[str]:
    async for detail, transcripts in store.export_sessions(run_id, where, gamma=gamma):
        line = trajectory_line(detail, transcripts)
        yield json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n"
