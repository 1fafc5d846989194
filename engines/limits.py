"""What the embedded engine accepts beyond `engines.base.check_request`, and the largest policy
version any engine may serve.

`check_request` holds what every engine refuses; the local engine (in this process or its own)
also turns request fields into torch tensors and indexes with them, so it refuses here, before
anything reaches torch, what would overflow or index out of range there: stop token ids outside
the vocabulary, and temperatures so small that `logits / temperature` leaves float32. A `top_k`
or `top_logprobs` larger than the vocabulary is not an error: the engine clamps it (a top-k of
the whole vocabulary truncates nothing). Seeds are already bounded by `SamplingParams.validate`
to the 64 bits a `torch.Generator` takes.

This module imports neither torch nor transformers (the gateway's admin route reads
`MAX_POLICY_VERSION`).
"""

from __future__ import annotations

from engines.base import GenerateRequest, check_request
from engines.errors import InvalidSamplingError
from engines.grammar import constraint_grammar

MAX_POLICY_VERSION = 2**31 - 1
"""The store records policy versions as int32 (`store.arrays`): no engine serves a larger one."""

MIN_TEMPERATURE = 1e-6
"""The smallest non-zero temperature: below it `logits / temperature` may overflow float32, and
sampling is greedy in all but name (ask for 0)."""


def check_local_request(request: GenerateRequest, *, max_model_len: int, vocab_size: int) -> None:
    """`check_request`, plus the bounds of the local engine (`InvalidRequestError` subclasses,
    each naming the field and its limit)."""
    check_request(request, max_model_len=max_model_len, vocab_size=vocab_size)
    sp = request.sampling
    constraint_grammar(sp.json_schema, sp.grammar)
    if 0.0 < sp.temperature < MIN_TEMPERATURE:
        raise InvalidSamplingError(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {sp.temperature}"
        )
    for t in sp.stop_token_ids:
        if t >= vocab_size:
            raise InvalidSamplingError(
                f"stop_token_ids must be token ids in [0, {vocab_size}) (this model's "
                f"vocabulary), got {t}"
            )
