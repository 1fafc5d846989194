"""The sampling contract (`store.run_config`, module docstring) applied to one request.

A request of a session samples under its run's config: under `record` with the client's settings,
the run's `temperature` where the client sends none; under `run` at the run's temperature with no
truncation (top_p 1, top_k 0, min_new_tokens 0), whatever the client sends. The settings used
are what the engine gets and what the turn's record holds (`record_of`), with the contract. A
request outside any session (the admin's unrecorded `/v1/...` calls) samples as OpenAI's default:
temperature 1, contract `record`.
"""

from __future__ import annotations

from typing import Any

from engines.base import SamplingParams
from store.run_config import ClientSampling, RunConfig
from store.types import JSON

UNRECORDED_TEMPERATURE = 1.0
"""The temperature of a request outside any run that sends none (OpenAI's default)."""


def contract_of(run: RunConfig | None) -> ClientSampling:
    """The contract a request samples under (`record` outside any run)."""
    return "record" if run is None else run.client_sampling


def sampling_params(
    body: Any, max_new: int | None, top_logprobs: int, run: RunConfig | None
) -> SamplingParams:
    """The settings a request of `run` (None: outside any run) samples with. `body` is a chat or
    completions request (`gateway.openai_types`)."""
    kept = {
        "seed": body.seed,
        "max_new_tokens": max_new,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "top_logprobs": top_logprobs,
    }
    if run is not None and run.client_sampling == "run":
        # what the trainer recomputes exactly: the run's temperature, nothing truncated or masked
        return SamplingParams(
            temperature=run.temperature, top_p=1.0, top_k=0, min_new_tokens=0, **kept
        )
    default = UNRECORDED_TEMPERATURE if run is None else run.temperature
    return SamplingParams(
        temperature=default if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_new_tokens=body.min_tokens,
        **kept,
    )


def record_of(sp: SamplingParams, contract: ClientSampling) -> JSON:
    """The turn's record of its sampling (`CompletionRecord.sampling`): every setting the engine
    got, and the contract it was sampled under."""
    return {f: getattr(sp, f) for f in sp.__dataclass_fields__} | {"contract": contract}
