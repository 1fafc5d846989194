"""The sampling contract (`store.run_config`, module docstring) applied to one request.

A request of a session samples under its run's config: under `record` with the client's settings,
the run's `temperature` where the client sends none; under `run` at the run's temperature with no
truncation (top_p 1, top_k 0, min_new_tokens 0), whatever the client sends. The settings used
are what the engine gets and what the turn's record holds (`record_of`), with the contract.
Under either contract a run that sets `max_tokens` caps the turn's new tokens at it (the turn
budget, `store.run_config`): the client's maximum when it is lower, the cap when the client sends
none or more. A request outside any session (the admin's unrecorded `/v1/...` calls) samples as
OpenAI's default: temperature 1, contract `record`, no cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engines.base import SamplingParams
from store.run_config import ClientSampling, RunConfig
from store.types import JSON

UNRECORDED_TEMPERATURE = 1.0
"""The temperature of a request outside any run that sends none (OpenAI's default)."""


def contract_of(run: RunConfig | None) -> ClientSampling:
    """The contract a request samples under (`record` outside any run)."""
    return "record" if run is None else run.client_sampling


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request asks of sampling, in any protocol's terms (None: it did not say)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """-1 or 0: off."""
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_new_tokens: int | None = None
    top_logprobs: int = 0
    json_schema: str | None = None
    """The JSON schema the reply must follow (structured outputs); kept under either contract."""


def max_tokens_cap(run: RunConfig | None) -> int | None:
    """The cap on a turn's new tokens: the run's `max_tokens` (None: no run, or it sets none)."""
    return None if run is None else run.max_tokens


def max_new_tokens(asked: int | None, run: RunConfig | None) -> int | None:
    """A turn's maximum of new tokens: what the client asked (None: it did not say), capped at
    the run's `max_tokens`."""
    cap = max_tokens_cap(run)
    if cap is None:
        return asked
    return cap if asked is None else min(asked, cap)


def sampling_params(asked: Asked, run: RunConfig | None) -> SamplingParams:
    """The settings a request of `run` (None: outside any run) samples with."""
    kept = SamplingParams(
        seed=asked.seed,
        max_new_tokens=max_new_tokens(asked.max_new_tokens, run),
        stop_token_ids=asked.stop_token_ids,
        ignore_eos=asked.ignore_eos,
        top_logprobs=asked.top_logprobs,
        json_schema=asked.json_schema,
    )
    if run is not None and run.client_sampling == "run":
        # what the trainer recomputes exactly: the run's temperature, nothing truncated or masked
        return replace(kept, temperature=run.temperature, top_p=1.0, top_k=0, min_new_tokens=0)
    default = UNRECORDED_TEMPERATURE if run is None else run.temperature
    return replace(
        kept,
        temperature=default if asked.temperature is None else asked.temperature,
        top_p=1.0 if asked.top_p is None else asked.top_p,
        top_k=max(0, asked.top_k or 0),
        min_new_tokens=asked.min_tokens,
    )


def record_of(sp: SamplingParams, contract: ClientSampling, cap: int | None = None) -> JSON:
    """The turn's record of its sampling (`CompletionRecord.sampling`): every setting the engine
    got, the contract it was sampled under and, under a run's turn budget, the cap
    (`max_tokens_cap`) its `max_new_tokens` was held to."""
    record = {f: getattr(sp, f) for f in sp.__dataclass_fields__} | {"contract": contract}
    return record if cap is None else record | {"max_tokens_cap": cap}
