"""`/v1/completions`: a text or token-id prompt, n choices, recorded like chat turns.

A token prompt that starts with one of the session's completion segments extends it (the exact
tokens are right there in the prompt); one that repeats the prompt of a segment's aborted last turn
(or, for a retry, of its completed last turn) takes that turn's place (`gateway.segments`);
anything else opens a segment. Failures, disconnects and streams behave as in `gateway/chat.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio

from engines.base import Engine, SamplingParams
from gateway.chat import choice_requests
from gateway.chat_render import ChatRenderer
from gateway.choices import (
    ChoiceRun,
    EventStream,
    RunGroup,
    TokenPieces,
    completion_logprobs,
    sse_chunk,
    sse_error,
)
from gateway.detok import IncrementalDecoder
from gateway.errors import BadRequest
from gateway.openai_types import CompletionRequest
from gateway.recorder import ChoiceOutcome, Match, Plan, Recorder
from gateway.sampling import contract_of, record_of, sampling_params
from gateway.segments import LiveSegment, extends_tokens, repeats_tokens
from store.run_config import ClientSampling, RunConfig
from store.types import TurnStatus

COMPLETION_TRANSCRIPT = {"kind": "completion"}


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
    def __init__(
        self, engine: Engine, renderer: ChatRenderer, recorder: Recorder | None, model_name: str
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.recorder = recorder
        self.model_name = model_name
        self.pieces = TokenPieces(renderer.tokenizer)

    async def _plan(
        self, prompt: list[int], session_id: str | None, n: int, retry: bool
    ) -> Plan | None:
        if session_id is None or self.recorder is None:
            return None

        def given() -> list[int]:
            return prompt

        def choose(segments: list[LiveSegment]) -> Match | None:
            for seg in reversed(segments):
                if extends_tokens(seg, prompt):
                    return Match(seg, given)
                last = seg.replaceable(retry=retry)
                if last is not None and repeats_tokens(seg, last, prompt):
                    return Match(seg, given, last)
            return None

        return await self.recorder.plan(session_id, n, choose, given)

    async def create(
        self,
        body: CompletionRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
    ) -> dict[str, Any] | EventStream:
        """As `ChatService.create`."""
        top = body.logprobs or 0
        sp = sampling_params(body, body.max_tokens, top, run)
        groups: list[tuple[list[int], Plan | None, list[ChoiceRun]]] = []
        prompts = await asyncio.to_thread(prompts_of, body, self.renderer)
        try:
            for prompt in prompts:
                plan = await self._plan(prompt, session_id, body.n, retry)
                groups.append((prompt, plan, []))
                for req in choice_requests(
                    sp, prompt, body.n, session_id, stream=bool(body.stream)
                ):
                    groups[-1][2].append(
                        ChoiceRun(
                            index=len(groups[-1][2]) + (len(groups) - 1) * body.n,
                            request=req,
                            stream=self.engine.generate(req),
                            decoder=IncrementalDecoder(
                                self.renderer.tokenizer, body.stop_strings(), holdback=[]
                            ),
                        )
                    )
        except BaseException:
            self._release(groups)
            raise
        turn = _CompletionTurn(self, body, groups, sp, contract_of(run))
        if body.stream:
            await turn.start_stream()
            return EventStream(turn.stream(), turn.close)
        return await turn.complete()

    def _release(self, groups: list[tuple[list[int], Plan | None, list[ChoiceRun]]]) -> None:
        for _, plan, _ in groups:
            if plan is not None and self.recorder is not None:
                self.recorder.release(plan)


class _CompletionTurn:
    def __init__(
        self,
        service: CompletionService,
        body: CompletionRequest,
        groups: list[tuple[list[int], Plan | None, list[ChoiceRun]]],
        sampling: SamplingParams,
        contract: ClientSampling,
    ) -> None:
        self.s = service
        self.body = body
        self.groups = groups
        self.sampling = sampling
        self.contract = contract
        self.id = f"cmpl-{uuid.uuid4().hex[:29]}"
        self.created = int(time.time())
        self.runs = [r for _, _, runs in groups for r in runs]
        self.done = False
        self.group = RunGroup(self.runs)

    def completion_id(self, i: int) -> str:
        return self.id if len(self.runs) == 1 else f"{self.id}-{i}"

    def _choice(self, run: ChoiceRun) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(self.s.pieces, run.ids, run.logprobs, run.top_logprobs)
        return {
            "index": run.index,
            "text": run.decoder.text,
            "logprobs": logprobs,
            "finish_reason": run.finish_reason or "abort",
            "completion_id": self.completion_id(run.index),
        }

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(p) * len(runs) for p, _, runs in self.groups) // max(1, self.body.n)
        completion = sum(len(r.ids) for r in self.runs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def _commit(self, aborted: bool) -> None:
        recorder = self.s.recorder
        if recorder is None or self.done:
            return
        self.done = True
        request = self.body.model_dump(mode="json", exclude_none=True)
        sampling = record_of(self.sampling, self.contract)
        for _, plan, runs in self.groups:
            if plan is None:
                continue
            if aborted and not any(r.ids for r in runs):
                recorder.release(plan)
                continue
            outcomes = []
            for r in runs:
                if aborted:
                    r.mark_aborted()
                choice = self._choice(r)
                outcomes.append(
                    ChoiceOutcome(
                        completion_id=self.completion_id(r.index),
                        transcript=dict(COMPLETION_TRANSCRIPT),
                        output_ids=list(r.ids),
                        logprobs=list(r.logprobs),
                        versions=list(r.versions),
                        finish_reason=choice["finish_reason"],
                        status=TurnStatus.ABORTED if aborted else TurnStatus.OK,
                        response=choice,
                        latency_ms=r.latency_ms,
                        ttft_ms=r.ttft_ms,
                    )
                )
            await recorder.commit(plan, outcomes, sampling, request)

    def _release(self) -> None:
        if not self.done:
            self.done = True
            self.s._release(self.groups)

    async def complete(self) -> dict[str, Any]:
        try:
            await self.group.wait()
        except BaseException as exc:
            self.group.cancel()
            with anyio.CancelScope(shield=True):  # as in gateway/chat.py: cancelled is aborted
                await self.group.settle()
                if isinstance(exc, Exception):
                    self._release()
                else:
                    await self._commit(aborted=True)
            raise
        await self._commit(aborted=False)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.s.model_name,
            "choices": [self._choice(r) for r in self.runs],
            "usage": self._usage(),
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        return sse_chunk(
            "text_completion",
            id=self.id,
            created=self.created,
            model=self.s.model_name,
            choices=choices,
            usage=usage,
        )

    async def start_stream(self) -> None:
        """Start generating; return once a choice has produced its first piece (a failure before
        it is an HTTP error)."""
        try:
            await self.group.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop generating; record what was generated, aborted, unless committed (idempotent)."""
        self.group.cancel()
        with anyio.CancelScope(shield=True):  # see gateway/chat.py: record it anyway
            await self.group.settle()
            await self._commit(aborted=True)

    async def stream(self) -> AsyncIterator[str]:
        sent = [0] * len(self.runs)
        try:
            try:
                async for run in self.group.progress():
                    text = run.decoder.safe_text()
                    if len(text) > sent[run.index]:
                        yield self._chunk(
                            [
                                {
                                    "index": run.index,
                                    "text": text[sent[run.index] :],
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                        sent[run.index] = len(text)
                await self._commit(aborted=False)
            except Exception as exc:  # failed after the stream began: see gateway/chat.py
                await self.close()
                yield sse_error(exc)
                yield "data: [DONE]\n\n"
                return
            for run in self.runs:
                yield self._chunk(
                    [
                        {
                            "index": run.index,
                            "text": run.decoder.text[sent[run.index] :],
                            "logprobs": None,
                            "finish_reason": run.finish_reason,
                        }
                    ]
                )
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield self._chunk([], usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            await self.close()
