"""The inference-engine protocol and the typed structs that cross it.

Every engine (the embedded `local` one, the `vllm` and `sglang` HTTP adapters, the router) takes
token ids and sampling parameters and streams back sampled token ids with, for each token, its
behaviour logprob and the policy version that produced it. Engines never see text: the gateway owns
tokenization (docs/architecture.md, "Contracts": token truth).

Behaviour logprob: the log-probability of the sampled token under the distribution it was sampled
from, `log_softmax(logits / temperature)`, *before* top-p/top-k truncation and before min-token
masking, which is what the trainer recomputes. With temperature 0 (greedy) it is
`log_softmax(logits)`. A grammar (`SamplingParams.json_schema`) is the exception: its mask is
applied to the logits first, as vLLM and SGLang do, so a constrained token's behaviour logprob is
the masked distribution's (`store.run_config`, "Constrained turns", says how those are trained).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engines.errors import (
    EmptyPromptError,
    InvalidSamplingError,
    PromptTooLongError,
    TokenOutOfRangeError,
)

if TYPE_CHECKING:
    import torch


MAX_TOP_LOGPROBS = 20


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An end-of-sequence or stop token was sampled (it is the last token of the output)."""
    LENGTH = "length"
    """`max_new_tokens` or the model's context was reached."""
    ABORT = "abort"
    """The request was aborted (by `abort`, a cancelled consumer, or engine shutdown)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample. `validate()` raises `InvalidSamplingError` naming the bad field."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and weights give the same tokens, batched or not."""
    max_new_tokens: int | None = None
    """At most this many new tokens; None means until the context is full."""
    min_new_tokens: int = 0
    """End-of-sequence and stop tokens are masked until this many tokens were generated."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the model's eos ids always do, unless ignore_eos)."""
    ignore_eos: bool = False
    """Do not stop on the model's eos ids (stop_token_ids still stop)."""
    top_logprobs: int = 0
    """Also return the k most likely tokens and their behaviour logprobs at each step (0-20)."""
    json_schema: str | None = None
    """Constrain the output to JSON valid against this schema (JSON text; `{"type": "object"}`
    is JSON mode): grammar-constrained decoding (`engines.grammar`). The behaviour logprob of a
    constrained token is then the masked distribution's."""
    grammar: str | None = None
    """Constrain the output to a grammar in llguidance's Lark dialect (text literals, `%json{}`
    for a JSON value held to a schema): how a forced tool call's markup and arguments are held
    (`gateway.core.tool_grammars`). At most one of `json_schema` and `grammar`."""

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidSamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidSamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InvalidSamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidSamplingError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidSamplingError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.json_schema is not None and self.grammar is not None:
            raise InvalidSamplingError("json_schema and grammar cannot both constrain one request")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise InvalidSamplingError(f"seed must fit in 64 bits, got {self.seed}")


def _new_request_id() -> str:
    return f"gen-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """Token ids in. `prompt_ids` is non-empty; `request_id` is unique among live requests."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=_new_request_id)
    stream_interval: int = 1
    """The engine may hold sampled tokens back until this many are ready and deliver them as one
    chunk (the first token, the last chunk, an abort and an error are never held back). A
    consumer that wants only the whole output (a non-streaming request) asks for a large interval
    and gets a few chunks instead of one per token, with the same tokens, logprobs and versions.
    An engine may deliver more often (vLLM and SGLang servers batch by their own settings)."""

    def validate(self) -> None:
        if not self.prompt_ids:
            raise EmptyPromptError()
        if self.stream_interval < 1:
            raise InvalidSamplingError(f"stream_interval must be >= 1, got {self.stream_interval}")
        self.sampling.validate()


def check_request(request: GenerateRequest, *, max_model_len: int, vocab_size: int) -> None:
    """The checks every engine makes before accepting `request` (`InvalidRequestError`)."""
    request.validate()
    n_prompt = len(request.prompt_ids)
    asked = request.sampling.max_new_tokens
    if n_prompt >= max_model_len or (asked is not None and n_prompt + asked > max_model_len):
        raise PromptTooLongError(n_prompt, asked or 0, max_model_len)
    for t in request.prompt_ids:
        if not 0 <= t < vocab_size:
            raise TokenOutOfRangeError(t, vocab_size)


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """A streamed piece of output: the tokens sampled since the previous chunk.

    Invariant: `token_ids`, `logprobs` and `versions` have one length (possibly 0 on the final
    chunk); `top_logprobs` has that length too when the request asked for top logprobs, else it is
    empty. `finish_reason` is set on the last chunk of a request and only there.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per token, the (token id, logprob) pairs of the k most likely tokens, most likely first."""


def join_chunks(chunks: list[TokenChunk]) -> TokenChunk:
    """Consecutive chunks of one request as one (the finish reason is the last chunk's)."""
    if len(chunks) == 1:
        return chunks[0]
    return TokenChunk(
        tuple(t for c in chunks for t in c.token_ids),
        tuple(lp for c in chunks for lp in c.logprobs),
        tuple(v for c in chunks for v in c.versions),
        chunks[-1].finish_reason,
        tuple(top for c in chunks for top in c.top_logprobs),
    )


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A whole generation. Invariant: `token_ids`, `logprobs` and `versions` have one length."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of a broadcast: its HF checkpoint name, torch dtype name (`float32`,
    `bfloat16`, ...) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """A process group for weight broadcasts: the trainer is rank 0 and opens the rendezvous
    (a `torch.distributed.TCPStore` at `master_address:master_port`); the engines' workers take
    ranks 1 .. world_size - 1. `backend` is the torch.distributed backend of both sides ("nccl"
    between GPUs, "gloo" on CPU); `timeout_s` bounds the join and every broadcast."""

    master_address: str
    master_port: int
    world_size: int
    backend: str = "nccl"
    name: str = "rlgateway-weights"
    timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Weights that arrive over the engine's `WeightGroup` while its rank 0 sends them: the
    tensors in this order, one `broadcast` each, cut into buckets that the server receives and
    loads one at a time (so its memory for the transfer is bounded by the largest bucket)."""

    buckets: tuple[tuple[TensorMeta, ...], ...]

    def tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(t for bucket in self.buckets for t in bucket)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightUpdate:
    """New policy weights. Exactly one of `state_dict` (in-process tensors, names as in the HF
    checkpoint), `path` (a HF model directory with safetensors files) or `broadcast` (tensors
    sent over the engine's weight group meanwhile: remote servers only) is set. `version`, when
    given, must be greater than the engine's current version; None means current + 1."""

    state_dict: Mapping[str, torch.Tensor] | None = None
    path: Path | None = None
    broadcast: Broadcast | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        given = (self.state_dict is not None, self.path is not None, self.broadcast is not None)
        if sum(given) != 1:
            raise ValueError("a WeightUpdate carries exactly one of state_dict, path or broadcast")


@dataclass(frozen=True, slots=True)
class ServerState:
    """One server behind a router (`engines.router`), as the router sees it."""

    name: str
    version: int
    """The policy version the server last said it serves."""
    state: str
    """`up` (in rotation), `down` (not answering, or unhealthy) or `stale` (answering, at
    another version than the router's: out of rotation until it is re-synced)."""
    detail: str = ""
    """Why it is not up (the last probe's or re-sync's error)."""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    ok: bool
    """False when the engine cannot serve (closed, its worker died, or restarting)."""
    paused: bool
    version: int
    running: int
    """Requests being decoded now."""
    waiting: int
    """Requests admitted but not yet prefilled."""
    detail: str = ""
    """Why the engine is not ok (empty while it is)."""
    restarts: int = 0
    """Times the engine was started again after it died (`engines.process`)."""
    servers: tuple[ServerState, ...] = ()
    """A router's servers, one each (empty for a single engine)."""


@runtime_checkable
class Engine(Protocol):
    """The one seam between the gateway/trainer and whatever samples tokens."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Stream the generation. Raises `InvalidRequestError` subclasses before the first chunk
        for bad input. Closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Finish a live request now with `FinishReason.ABORT`; unknown ids are ignored."""
        ...

    async def pause(self) -> None:
        """Stop decoding after the current step; requests stay queued. Idempotent."""
        ...

    async def resume(self) -> None:
        """Continue decoding after `pause`. Idempotent."""
        ...

    async def update_weights(self, update: WeightUpdate) -> int:
        """Swap the weights between decode steps and return the new version. In-flight requests
        continue; their tokens sampled after the swap carry the new version."""
        ...

    def version(self) -> int:
        """The policy version that the next sampled token will carry."""
        ...

    async def health(self) -> EngineHealth: ...

    async def close(self) -> None:
        """Abort every live request and release resources. Idempotent."""
        ...


@runtime_checkable
class WeightGroupMember(Protocol):
    """An engine whose servers can receive weights over a process group (`WeightGroup`): the
    remote adapters, and the router over them. The in-process engines are not: they take state
    dicts."""

    async def weight_group_ranks(self) -> int:
        """How many ranks of a weight group this engine's servers take (their workers)."""
        ...

    def weight_group_intact(self) -> bool:
        """Whether the group joined last can take a broadcast now (every server in it)."""
        ...

    async def join_weight_group(self, group: WeightGroup, rank_offset: int = 1) -> None:
        """Join `group` with ranks from `rank_offset` on; blocks until its rank 0 joins too, so
        run it beside the trainer's side. Raises `WeightUpdateError` when any server cannot."""
        ...


async def collect(engine: Engine, request: GenerateRequest) -> GenerateResult:
    """Run `request` to completion and gather its chunks into one `GenerateResult`."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    finish: FinishReason | None = None
    async for chunk in engine.generate(request):
        token_ids += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        tops += chunk.top_logprobs
        finish = chunk.finish_reason or finish
    assert finish is not None, "an engine stream ended without a finish reason"
    return GenerateResult(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids,
        token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        versions=tuple(versions),
        finish_reason=finish,
        top_logprobs=tuple(tops),
    )
