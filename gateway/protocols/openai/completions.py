"""`/v1/completions` on the turn core (`gateway.core.turn`): a text or token-id prompt (or several),
n choices each, recorded like chat turns.

A token prompt that starts with one of the session's completion segments extends it (the exact
tokens are right there in the prompt); one that repeats the prompt of a segment's aborted last turn
(or, for a retry, of its completed last turn) takes that turn's place (`gateway.core.segments`);
anything else opens a segment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.core.chat_render import ChatRenderer
from gateway.core.choices import EventStream, TokenPieces
from gateway.core.turn import TurnCore
from gateway.core.turn_run import Turn
from gateway.core.turn_types import Choice, Exchange, Prompt, TokenPrompt, TurnSpec
from gateway.errors import BadRequest
from gateway.protocols.openai.sse import sse_stream, usage_of
from gateway.protocols.openai.types import CompletionRequest
from store.run_config import RunConfig
from store.types import JSON


def prompts_of(body: CompletionRequest, renderer: ChatRenderer) -> list[list[int]]:
    p = body.prompt
    if body.echo:
        raise BadRequest("echo is not supported: the prompt is yours already", param="echo")
    if isinstance(p, str):
        return [renderer.encode(p)]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    if p and all(isinstance(x, str) for x in p):
        return [renderer.encode(x) for x in p]  # type: ignore[arg-type]
    if p and all(isinstance(x, list) for x in p):
        return [list(x) for x in p]  # type: ignore[arg-type]
    raise BadRequest("prompt must be a string, token ids, or a list of either", param="prompt")


class CompletionService:
    def __init__(self, core: TurnCore) -> None:
        self.core = core

    async def create(
        self,
        body: CompletionRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        exchange: Exchange | None = None,
    ) -> dict[str, Any] | EventStream:
        """As `ChatService.create`."""
        ids = await asyncio.to_thread(prompts_of, body, self.core.renderer)
        prompts: list[Prompt] = [TokenPrompt(p) for p in ids]
        spec = TurnSpec(
            protocol="completions",
            id_prefix="cmpl-",
            prompts=prompts,
            asked=body.asked(body.max_tokens, body.logprobs or 0),
            n=body.n,
            stop=body.stop_strings(),
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
        )
        respond = _Respond(body)
        turn = await self.core.start(
            spec, session_id, run=run, retry=retry, exchange=exchange, respond=respond.choice
        )
        if body.stream:
            return EventStream(_stream(turn, body), turn.close)
        choices = await turn.complete()
        return {
            "id": turn.id,
            "object": "text_completion",
            "created": turn.created,
            "model": turn.model,
            "choices": [respond.choice(turn, c) for c in choices],
            "usage": usage_of(turn),
        }


class _Respond:
    def __init__(self, body: CompletionRequest) -> None:
        self.body = body

    def choice(self, turn: Turn, c: Choice) -> JSON:
        logprobs = None
        if self.body.logprobs is not None:
            r = c.run
            logprobs = completion_logprobs(turn.context.pieces, r.ids, r.logprobs, r.top_logprobs)
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "completion_id": c.completion_id,
        }


def _text(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


def _stream(turn: Turn, body: CompletionRequest) -> AsyncIterator[str]:
    opts = body.stream_options
    return sse_stream(
        turn,
        "text_completion",
        opening=[],
        delta=lambda d: _text(d.run.index, d.text) if d.text else None,
        closing=lambda c: _text(c.index, turn.unsent(c), c.finish_reason),
        include_usage=opts is not None and opts.include_usage,
    )


def completion_logprobs(
    pieces: TokenPieces,
    ids: list[int],
    logprobs: list[float],
    tops: list[tuple[tuple[int, float], ...]],
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI legacy completions `logprobs` for sampled tokens."""
    tokens, offsets, top = [], [], []
    pos = offset
    for i, tok in enumerate(ids):
        text, _ = pieces(tok)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if i < len(tops):
            top.append({pieces(a)[0]: lp for a, lp in tops[i]})
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": top or None,
        "text_offset": offsets,
    }
