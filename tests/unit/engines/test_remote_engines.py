"""Hermetic pieces of the vLLM/SGLang adapters and the router: response parsing, metrics,
request ids, placement, and the `serve --engine` flags."""

from __future__ import annotations

import pytest

from engines.base import FinishReason, GenerateRequest
from engines.router import default_session_of
from engines.sglang import _piece as sglang_piece
from engines.vllm import _completion_piece, _generate_piece, parse_load
from gateway.core.turn import choice_requests
from rlgateway.cli import main

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 5.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 123.0
"""


def test_vllm_load_sums_engines_and_ignores_other_series() -> None:
    assert parse_load(METRICS) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 7.0,
    }


def test_vllm_choice_with_top_logprobs_keyed_by_token_id() -> None:
    choice = {
        "token_ids": [7, 9],
        "logprobs": {
            "token_logprobs": [-0.5, -1.5],
            # vLLM adds the sampled token to the k most likely ones.
            "top_logprobs": [
                {"token_id:7": -0.5, "token_id:3": -0.9},
                {"token_id:4": -0.2, "token_id:9": -1.5, "token_id:5": -0.7},
            ],
        },
        "finish_reason": None,
    }
    piece = _completion_piece(choice, 2)
    assert piece.token_ids == (7, 9)
    assert piece.logprobs == (-0.5, -1.5)
    assert piece.top_logprobs == (((7, -0.5), (3, -0.9)), ((4, -0.2), (5, -0.7)))
    assert piece.finish is None
    last = _completion_piece({"token_ids": [], "logprobs": None, "finish_reason": "abort"}, 0)
    assert (last.token_ids, last.finish) == ((), FinishReason.ABORT)


def test_vllm_generate_choice_gives_the_same_piece_as_the_completion_one() -> None:
    """`/inference/v1/generate` lists each token's candidates with ids (the sampled one first,
    then the most likely, the sampled one not repeated); the piece is the completion route's."""

    def cand(t: int, lp: float) -> dict[str, float | int]:
        return {"token_id": t, "logprob": lp, "rank": 1}

    content = [
        {"token_id": 7, "logprob": -0.5, "top_logprobs": [cand(7, -0.5), cand(3, -0.9)]},
        {
            "token_id": 9,
            "logprob": -1.5,
            "top_logprobs": [cand(9, -1.5), cand(4, -0.2), cand(5, -0.7)],
        },
    ]
    choice = {"token_ids": [7, 9], "logprobs": {"content": content}, "finish_reason": "length"}
    piece = _generate_piece(choice, 2)
    assert piece.token_ids == (7, 9)
    assert piece.logprobs == (-0.5, -1.5)
    assert piece.top_logprobs == (((7, -0.5), (3, -0.9)), ((4, -0.2), (5, -0.7)))
    assert piece.finish == FinishReason.LENGTH
    assert _generate_piece(choice, 0).top_logprobs == ()
    last = _generate_piece({"token_ids": [], "logprobs": None, "finish_reason": "abort"}, 0)
    assert (last.token_ids, last.finish) == ((), FinishReason.ABORT)


def test_sglang_cumulative_and_incremental_events_give_the_same_tokens() -> None:
    triples = [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None]]
    cumulative = {"output_token_logprobs": triples, "completion_tokens": 3, "finish_reason": None}
    incremental = {"output_token_logprobs": triples[2:], "completion_tokens": 3}
    for meta in (cumulative, incremental):
        piece = sglang_piece(meta, seen=2, k=0)
        assert piece.token_ids == (13,)
        assert piece.logprobs == (-0.3,)
    done = {
        "output_token_logprobs": triples,
        "completion_tokens": 3,
        "finish_reason": {"type": "length", "length": 3},
    }
    assert sglang_piece(done, seen=3, k=0).finish == FinishReason.LENGTH
    stop = {
        "output_token_logprobs": triples,
        "completion_tokens": 3,
        "finish_reason": {"type": "stop", "matched": 13},
    }
    assert sglang_piece(stop, seen=0, k=0).token_ids == (11, 12, 13)


def test_gateway_request_ids_carry_the_session_for_affinity() -> None:
    from engines.base import SamplingParams

    reqs = choice_requests(SamplingParams(seed=1), [1, 2], 2, "sess-9")
    assert [default_session_of(r) for r in reqs] == ["sess-9", "sess-9"]
    assert reqs[0].request_id != reqs[1].request_id
    assert default_session_of(GenerateRequest(prompt_ids=(1,))) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "vllm"], "needs --engine-url"),
        (["--engine-url", "http://x"], "go with --engine vllm or sglang"),
        (["--engine", "sglang", "--engine-launch", "--engine-url", "http://x"], "not both"),
        (["--engine", "vllm", "--engine-launch", "--engine-url", "http://x"], "not both"),
        (["--train", "publish.mode=collective"], "publish.mode collective broadcasts to vLLM"),
    ],
)
def test_serve_engine_flags_are_checked(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--admin-token", "t", *args]) == 2
    assert message in capsys.readouterr().err
