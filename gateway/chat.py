"""`/v1/chat/completions`: render, plan the segment, generate n choices, parse tool calls, commit,
respond (JSON or server-sent events).

The response is sent only after its completions are committed; a stream's final chunks (finish
reasons, usage) likewise wait for the commit. A turn whose client goes away (a stream, or a request
cancelled because its client disconnected) is committed with what was generated, marked aborted;
so is a stream whose engine fails after its first token, which then ends with an SSE error event.
A stream answers only once its first piece was generated: a failure before it is an HTTP error.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio

from engines.base import Engine, GenerateRequest, SamplingParams
from gateway.chat_render import (
    TOOL_CALL_OPEN,
    ChatRenderer,
    ParsedToolCall,
    normalize_messages,
    normalize_tools,
    parse_tool_calls,
    tool_call_json,
)
from gateway.choices import (
    ChoiceRun,
    EventStream,
    RunGroup,
    TokenPieces,
    chat_logprobs,
    sse_chunk,
    sse_error,
)
from gateway.detok import IncrementalDecoder
from gateway.errors import BadRequest
from gateway.openai_types import ChatCompletionRequest, NamedToolChoice
from gateway.recorder import ChoiceOutcome, Match, Plan, Recorder
from gateway.sampling import contract_of, record_of, sampling_params
from gateway.segments import LiveSegment, chat_transcript, extends, repeats
from store.run_config import ClientSampling, RunConfig
from store.types import JSON, LastTurn, TurnStatus


@dataclass(frozen=True, slots=True)
class ChatInputs:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    parse_tools: bool
    prefill: str
    """Text forced at the start of the reply (tool_choice required/named); part of the prompt."""


def chat_inputs(body: ChatCompletionRequest) -> ChatInputs:
    tools = normalize_tools(body.tools)
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise BadRequest(
            "tool_choice needs tools: pass the tools to choose from", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t["function"]["name"] for t in tools}:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
    return ChatInputs(normalize_messages(body.messages), tools, choice != "none", _prefill(choice))


def _prefill(choice: str | NamedToolChoice | None) -> str:
    if isinstance(choice, NamedToolChoice):
        return _named_prefill(choice.function.name)
    return f"{TOOL_CALL_OPEN}\n" if choice == "required" else ""


def _named_prefill(name: str) -> str:
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def recorded_prefill(request: JSON) -> str:
    """The prefill of a recorded request (its stored body, as `_Turn._commit` dumps it)."""
    choice = request.get("tool_choice")
    if isinstance(choice, dict):
        return _named_prefill(str(choice["function"]["name"]))
    return f"{TOOL_CALL_OPEN}\n" if choice == "required" else ""


WHOLE_OUTPUT_INTERVAL = 16
"""`GenerateRequest.stream_interval` of a non-streaming request: its response waits for the whole
output, so the engine hands tokens over 16 at a time instead of one message per token (as the
vLLM adapter's `stream_interval`). A stop string is still seen in the chunk that completes it."""


def choice_requests(
    sp: SamplingParams,
    prompt: list[int],
    n: int,
    session_id: str | None = None,
    *,
    stream: bool = True,
) -> list[GenerateRequest]:
    """n engine requests; with a seed, choice i uses seed + i so choices differ but reproduce.
    A session's request ids start with "{session_id}/", which a router uses for affinity.
    `stream=False`: the caller wants whole outputs (see `WHOLE_OUTPUT_INTERVAL`)."""
    out = []
    interval = 1 if stream else WHOLE_OUTPUT_INTERVAL
    for i in range(n):
        seed = None if sp.seed is None else sp.seed + i
        params = SamplingParams(
            **{**{f: getattr(sp, f) for f in sp.__dataclass_fields__}, "seed": seed}
        )
        req = GenerateRequest(prompt_ids=tuple(prompt), sampling=params, stream_interval=interval)
        if session_id is not None:
            req = replace(req, request_id=f"{session_id}/{req.request_id}")
        out.append(req)
    return out


class ChatService:
    def __init__(
        self, engine: Engine, renderer: ChatRenderer, recorder: Recorder | None, model_name: str
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.recorder = recorder
        self.model_name = model_name
        self.pieces = TokenPieces(renderer.tokenizer)

    # -- planning ----------------------------------------------------------------------------

    async def _prompt(
        self, inputs: ChatInputs, session_id: str | None, n: int, retry: bool
    ) -> tuple[list[int], Plan | None]:
        r = self.renderer
        fresh = functools.partial(r.prompt, inputs.messages, inputs.tools, inputs.prefill)
        if session_id is None or self.recorder is None:
            return await asyncio.to_thread(fresh), None

        def choose(segments: list[LiveSegment]) -> Match | None:
            for seg in reversed(segments):
                transcript = seg.transcript
                assert transcript is not None
                if extends(transcript, inputs.messages, inputs.tools):
                    render = functools.partial(
                        r.continuation,
                        seg.tokens,
                        transcript["messages"],
                        inputs.messages,
                        inputs.tools,
                        inputs.prefill,
                    )
                    return Match(seg, render)
                last = seg.replaceable(retry=retry)
                if last is not None and self._repeats(seg, last, inputs):
                    return Match(seg, functools.partial(list, seg.tokens[: last.prompt_len]), last)
            return None

        plan = await self.recorder.plan(session_id, n, choose, fresh)
        return plan.prompt_ids, plan

    @staticmethod
    def _repeats(seg: LiveSegment, last: LastTurn, inputs: ChatInputs) -> bool:
        """The request is the one `last` answered, so its prompt is `last`'s."""
        return repeats(seg.transcript, inputs.messages, inputs.tools) and (
            recorded_prefill(last.request) == inputs.prefill
        )

    # -- the request -------------------------------------------------------------------------

    async def create(
        self,
        body: ChatCompletionRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
    ) -> dict[str, Any] | EventStream:
        """The response (JSON), or for `stream` the SSE events, once the first piece was
        generated. `run`: the config of the session's run, which the request samples under
        (`gateway.sampling`; None outside a session). `retry`: the client says this repeats a
        request whose reply it never got (`gateway.segments`)."""
        inputs = chat_inputs(body)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        sp = sampling_params(body, body.max_completion_tokens or body.max_tokens, top, run)
        prompt, plan = await self._prompt(inputs, session_id, body.n, retry)
        try:
            runs = [
                ChoiceRun(
                    index=i,
                    request=req,
                    stream=self.engine.generate(req),  # validates: raises before any token
                    decoder=IncrementalDecoder(
                        self.renderer.tokenizer,
                        body.stop_strings(),
                        holdback=[TOOL_CALL_OPEN] if inputs.parse_tools else [],
                    ),
                )
                for i, req in enumerate(
                    choice_requests(sp, prompt, body.n, session_id, stream=bool(body.stream))
                )
            ]
        except BaseException:
            if plan is not None and self.recorder is not None:
                self.recorder.release(plan)
            raise
        turn = _Turn(self, body, inputs, prompt, plan, runs, sp, contract_of(run))
        if body.stream:
            await turn.start_stream()
            return EventStream(turn.stream(), turn.close)
        return await turn.complete()


class _Turn:
    """One chat request in flight."""

    def __init__(
        self,
        service: ChatService,
        body: ChatCompletionRequest,
        inputs: ChatInputs,
        prompt: list[int],
        plan: Plan | None,
        runs: list[ChoiceRun],
        sampling: SamplingParams,
        contract: ClientSampling,
    ) -> None:
        self.s = service
        self.body = body
        self.inputs = inputs
        self.prompt = prompt
        self.plan = plan
        self.runs = runs
        self.sampling = sampling
        self.contract = contract
        self.id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
        self.created = int(time.time())
        self.committed = False
        self.group = RunGroup(runs)

    def completion_id(self, i: int) -> str:
        return self.id if len(self.runs) == 1 else f"{self.id}-{i}"

    def _message(self, run: ChoiceRun) -> tuple[dict[str, Any], str]:
        text = self.inputs.prefill + run.decoder.text
        finish = run.finish_reason or "abort"
        calls: list[ParsedToolCall] = []
        content: str | None = text
        if self.inputs.parse_tools:
            content, calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = tool_call_json(calls, f"{self.id[-8:]}{run.index}")
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    def _choice_json(self, run: ChoiceRun) -> dict[str, Any]:
        message, finish = self._message(run)
        logprobs = None
        if self.body.logprobs:
            logprobs = {
                "content": chat_logprobs(self.s.pieces, run.ids, run.logprobs, run.top_logprobs)
            }
        return {
            "index": run.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "completion_id": self.completion_id(run.index),
        }

    def _usage(self) -> dict[str, int]:
        completion = sum(len(r.ids) for r in self.runs)
        prompt = len(self.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _outcome(self, run: ChoiceRun, choice: dict[str, Any], aborted: bool) -> ChoiceOutcome:
        message = choice["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
        return ChoiceOutcome(
            completion_id=self.completion_id(run.index),
            transcript=chat_transcript([*self.inputs.messages, reply], self.inputs.tools),
            output_ids=list(run.ids),
            logprobs=list(run.logprobs),
            versions=list(run.versions),
            finish_reason=choice["finish_reason"],
            status=TurnStatus.ABORTED if aborted else TurnStatus.OK,
            response=choice,
            latency_ms=run.latency_ms,
            ttft_ms=run.ttft_ms,
        )

    async def _commit(self, choices: list[dict[str, Any]], aborted: bool) -> None:
        if self.plan is None or self.s.recorder is None or self.committed:
            return
        self.committed = True
        outcomes = [self._outcome(r, c, aborted) for r, c in zip(self.runs, choices, strict=True)]
        sampling = record_of(self.sampling, self.contract) | {
            "stop": self.body.stop_strings(),
            "n": self.body.n,
        }
        request = self.body.model_dump(mode="json", exclude_none=True)
        await self.s.recorder.commit(self.plan, outcomes, sampling, request)

    def _release(self) -> None:
        if self.plan is not None and self.s.recorder is not None and not self.committed:
            self.committed = True
            self.s.recorder.release(self.plan)

    async def complete(self) -> dict[str, Any]:
        try:
            await self.group.wait()
        except BaseException as exc:
            self.group.cancel()
            # Cancelled (its client went away): record what was generated, aborted. Failed: the
            # client gets the error, and nothing is recorded.
            with anyio.CancelScope(shield=True):
                if isinstance(exc, Exception):
                    await self.group.settle()
                    self._release()
                else:
                    await self._abort_commit()
            raise
        choices = [self._choice_json(r) for r in self.runs]
        await self._commit(choices, aborted=False)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.s.model_name,
            "choices": choices,
            "usage": self._usage(),
            "system_fingerprint": None,
        }

    # -- streaming ---------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        return sse_chunk(
            "chat.completion.chunk",
            id=self.id,
            created=self.created,
            model=self.s.model_name,
            choices=choices,
            usage=usage,
        )

    async def start_stream(self) -> None:
        """Start generating and return once a choice has produced its first piece, so that a
        failure before it reaches the client as an HTTP error rather than a broken stream."""
        try:
            await self.group.start()
        except BaseException:
            await self.close()
            raise

    async def stream(self) -> AsyncIterator[str]:
        sent_text = [0] * len(self.runs)
        sent_tokens = [0] * len(self.runs)
        try:
            for run in self.runs:
                yield self._chunk(
                    [
                        {
                            "index": run.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            try:
                async for item in self.group.progress():
                    delta = self._delta(item, sent_text, sent_tokens)
                    if delta is not None:
                        yield self._chunk([delta])
                choices = [self._choice_json(r) for r in self.runs]
                await self._commit(choices, aborted=False)
            except Exception as exc:
                # The engine (or the store) failed after the stream began: record what was
                # generated, aborted, then say so in the stream and end it cleanly.
                await self.close()
                yield sse_error(exc)
                yield "data: [DONE]\n\n"
                return
            for run, choice in zip(self.runs, choices, strict=True):
                tail: dict[str, Any] = {}
                if choice["message"].get("tool_calls"):
                    calls = choice["message"]["tool_calls"]
                    tail["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                else:
                    rest = (self.inputs.prefill + run.decoder.text)[sent_text[run.index] :]
                    if rest:
                        tail["content"] = rest
                yield self._chunk(
                    [
                        {
                            "index": run.index,
                            "delta": tail,
                            "logprobs": None,
                            "finish_reason": choice["finish_reason"],
                        }
                    ]
                )
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield self._chunk([], usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop generating; record the turn, aborted, unless it was committed (idempotent)."""
        self.group.cancel()
        # The server cancels a response whose client left through an anyio cancel scope, which
        # would cancel these awaits too: shield them, the turn must be recorded.
        with anyio.CancelScope(shield=True):
            await self._abort_commit()

    async def _abort_commit(self) -> None:
        """The client went away (or the engine failed): keep what was generated, marked aborted
        (nothing, when nothing was generated)."""
        await self.group.settle()
        if self.committed:
            return
        if any(r.ids for r in self.runs):
            for r in self.runs:
                r.mark_aborted()
            choices = [self._choice_json(r) for r in self.runs]
            await self._commit(choices, aborted=True)
        else:
            self._release()

    def _delta(
        self, run: ChoiceRun, sent_text: list[int], sent_tokens: list[int]
    ) -> dict[str, Any] | None:
        """What to send for `run` now: new visible text (never tool-call markup, never what may
        still turn into a stop string) and the logprobs of new tokens."""
        i = run.index
        delta: dict[str, Any] = {}
        text = self.inputs.prefill + run.decoder.safe_text()
        if self.inputs.parse_tools and (at := text.find(TOOL_CALL_OPEN)) >= 0:
            text = text[:at]
        if len(text) > sent_text[i]:
            delta["content"] = text[sent_text[i] :]
            sent_text[i] = len(text)
        logprobs = None
        if self.body.logprobs and len(run.ids) > sent_tokens[i]:
            lo = sent_tokens[i]
            entries = chat_logprobs(
                self.s.pieces, run.ids[lo:], run.logprobs[lo:], run.top_logprobs[lo:]
            )
            logprobs = {"content": entries}
            sent_tokens[i] = len(run.ids)
        if not delta and logprobs is None:
            return None
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}
