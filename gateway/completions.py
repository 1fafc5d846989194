"""`/v1/completions` on the turn core (`gateway.turn`): a text or token-id prompt (or several),
n choices each, recorded like chat turns.

A token prompt that starts with one of the session's completion segments extends it (the exact
tokens are right there in the prompt); one that repeats the prompt of a segment's aborted last turn
(or, for a retry, of its completed last turn) takes that turn's place (`gateway.segments`);
anything else opens a segment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.chat_render import ChatRenderer
from gateway.choices import EventStream, completion_logprobs, sse_chunk, sse_error
from gateway.errors import BadRequest
from gateway.openai_types import CompletionRequest
from gateway.sampling import Asked
from gateway.turn import Choice, Prompt, TokenPrompt, Turn, TurnCore, TurnSpec
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
    ) -> dict[str, Any] | EventStream:
        """As `ChatService.create`."""
        ids = await asyncio.to_thread(prompts_of, body, self.core.renderer)
        prompts: list[Prompt] = [TokenPrompt(p) for p in ids]
        spec = TurnSpec(
            protocol="completions",
            id_prefix="cmpl-",
            prompts=prompts,
            asked=Asked(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_tokens=body.min_tokens,
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                max_new_tokens=body.max_tokens,
                top_logprobs=body.logprobs or 0,
            ),
            n=body.n,
            stop=body.stop_strings(),
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
        )
        respond = _Respond(body)
        turn = await self.core.start(spec, session_id, run=run, retry=retry, respond=respond.choice)
        if body.stream:
            return EventStream(_stream(turn, body), turn.close)
        choices = await turn.complete()
        return {
            "id": turn.id,
            "object": "text_completion",
            "created": turn.created,
            "model": turn.core.model_name,
            "choices": [respond.choice(turn, c) for c in choices],
            "usage": _usage(turn),
        }


class _Respond:
    def __init__(self, body: CompletionRequest) -> None:
        self.body = body

    def choice(self, turn: Turn, c: Choice) -> JSON:
        logprobs = None
        if self.body.logprobs is not None:
            r = c.run
            logprobs = completion_logprobs(turn.core.pieces, r.ids, r.logprobs, r.top_logprobs)
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "completion_id": c.completion_id,
        }


def _usage(turn: Turn) -> dict[str, int]:
    prompt, completion = turn.prompt_tokens, turn.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _chunk(turn: Turn, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
    return sse_chunk(
        "text_completion",
        id=turn.id,
        created=turn.created,
        model=turn.core.model_name,
        choices=choices,
        usage=usage,
    )


def _text(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


async def _stream(turn: Turn, body: CompletionRequest) -> AsyncIterator[str]:
    try:
        try:
            async for d in turn.deltas():
                if d.text:
                    yield _chunk(turn, [_text(d.run.index, d.text)])
        except Exception as exc:  # failed after the stream began (`gateway.turn`)
            await turn.close()
            yield sse_error(exc)
            yield "data: [DONE]\n\n"
            return
        for c in turn.choices:
            yield _chunk(turn, [_text(c.index, turn.unsent(c), c.finish_reason)])
        opts = body.stream_options
        if opts is not None and opts.include_usage:
            yield _chunk(turn, [], usage=_usage(turn))
        yield "data: [DONE]\n\n"
    finally:
        await turn.close()
