"""The gateway's sampling and the trainer's reproducibility rule are one contract: what the
gateway records for a turn is exactly what `reproducible_temperature` judges."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.sampling import record_of, sampling_params
from gateway.protocols.openai.chat import chat_spec
from gateway.protocols.openai.types import ChatCompletionRequest
from store.run_config import RunConfig, reproducible_temperature


def request(**sampling: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **sampling)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.0}, {"top_p": 0.5}, {"top_k": 5}, {"min_tokens": 3}, {"temperature": 2}],
)
def test_under_contract_run_every_turn_is_recorded_trainable_at_the_runs_temperature(
    sampling: dict[str, Any],
) -> None:
    run = RunConfig(temperature=0.7, client_sampling="run")
    record = record_of(
        sampling_params(chat_spec(request(**sampling)).asked, run), run.client_sampling
    )
    assert reproducible_temperature(record, default=1.0) == 0.7


@pytest.mark.parametrize(
    ("sampling", "trained_at"),
    [
        ({}, 0.7),  # nothing sent: the run's temperature
        ({"temperature": 1.3}, 1.3),
        ({"temperature": 0.0}, None),  # greedy
        ({"top_p": 0.9}, None),
        ({"top_p": 1.0, "top_k": 0}, 0.7),
        ({"top_k": 40}, None),
        ({"min_tokens": 2}, None),  # masks the end token
    ],
)
def test_under_contract_record_a_turn_is_trained_only_where_it_can_be_reproduced(
    sampling: dict[str, Any], trained_at: float | None
) -> None:
    run = RunConfig(temperature=0.7)
    record = record_of(
        sampling_params(chat_spec(request(**sampling)).asked, run), run.client_sampling
    )
    assert record["contract"] == "record"
    assert reproducible_temperature(record, default=run.temperature) == trained_at


def test_a_gateway_without_a_trainer_checks_only_the_run_owned_fields() -> None:
    from gateway.deps import check_run_fields

    check_run_fields({"eta": 2, "temperature": 0.7, "algo": {"anything": 1}})  # not its business
    with pytest.raises(ValueError, match=r"config\.eta: .* \(got -1\)"):
        check_run_fields({"eta": -1})
    with pytest.raises(ValueError, match=r"config\.client_sampling: .*'sometimes'"):
        check_run_fields({"client_sampling": "sometimes"})
