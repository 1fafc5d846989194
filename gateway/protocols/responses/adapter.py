"""`/v1/responses` on the turn core (`gateway.core.turn`): a Responses request to a `TurnSpec`,
and a turn's choice to a `response` object or its documented event stream.

`previous_response_id` continues the conversation of a kept response
(`gateway.protocols.responses.kept`): its messages come first, so the request extends the same
segment token for token, exactly as a client that sends the whole history again (`store: false`)
does. The stream is `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, (for a message) `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`, (for a
function call) `response.function_call_arguments.delta` and `.done`, then
`response.output_item.done` (a forced call opens its first item and streams its arguments as
they are sampled), and last `response.completed` (`response.incomplete` when it stopped at
`max_output_tokens`), or `response.failed` when the engine fails after the stream began. Every event
carries its `sequence_number`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from gateway.core.choices import ChoiceRun, EventStream
from gateway.core.media import media_of
from gateway.core.reasoning_parsers import seal_reasoning
from gateway.core.sampling import Asked
from gateway.core.turn import TurnCore
from gateway.core.turn_run import Turn
from gateway.core.turn_types import CallDelta, ChatPrompt, Choice, Exchange, TurnSpec
from gateway.errors import BadRequest, NotFound, translate
from gateway.protocols.common import chat_logprobs
from gateway.protocols.responses.kept import (
    KeptResponse,
    KeptResponses,
    conversation_of,
    open_calls_of,
)
from gateway.protocols.responses.types import (
    ResponsesRequest,
    input_messages,
    tool_choice_of,
    tools_of,
)
from store.run_config import RunConfig
from store.types import JSON

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SEALED_INCLUDE = "reasoning.encrypted_content"


class ResponsesService:
    def __init__(self, core: TurnCore, kept: KeptResponses) -> None:
        self.core = core
        self.kept = kept

    async def _prior(self, body: ResponsesRequest, session_id: str | None) -> KeptResponse | None:
        if body.previous_response_id is None:
            return None
        prior = await self.kept.get(body.previous_response_id, session_id)
        if prior is None:
            raise NotFound(
                f"previous response with id {body.previous_response_id!r} not found: it was not "
                "stored (store: false), belongs to another session, or never completed",
                param="previous_response_id",
            )
        return prior

    async def create(
        self,
        body: ResponsesRequest,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        exchange: Exchange | None = None,
    ) -> dict[str, Any] | EventStream:
        """The response (JSON), or for `stream` its events, once the first piece was generated
        (`TurnCore.start`)."""
        prior = await self._prior(body, session_id)
        tools = tools_of(body.tools).callable
        calls = tool_choice_of(body.tool_choice, {t["function"]["name"] for t in tools})
        calls = replace(calls, parallel=body.parallel_tool_calls is not False)
        messages = input_messages(
            body.input,
            open_calls=frozenset() if prior is None else prior.open_calls,
            media=media_of(run),
        )
        history = [] if prior is None else prior.conversation
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        if not messages and not history:
            raise BadRequest("input is empty: send a string or at least one item", param="input")
        spec = TurnSpec(
            protocol="responses",
            id_prefix="resp_",
            prompts=[
                ChatPrompt(
                    [*system, *history, *messages],
                    tools,
                    calls,
                    template_kwargs=body.chat_template_kwargs or {},
                )
            ],
            asked=Asked(
                temperature=body.temperature,
                top_p=body.top_p,
                max_new_tokens=body.max_output_tokens,
                top_logprobs=body.top_logprobs or 0,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                json_schema=body.json_schema,
            ),
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
            cap_to_context=True,
            edge_is_error=True,
        )
        shape = _Shape(body)
        turn = await self.core.start(
            spec, session_id, run=run, retry=retry, exchange=exchange, respond=shape.choice
        )
        if body.stream:
            return EventStream(self._stream(turn, shape, session_id, prior), turn.close)
        choice = (await turn.complete())[0]
        if choice.context_edge:
            raise context_exceeded(turn)
        response = shape.choice(turn, choice)
        self._keep(body, turn, response, session_id, prior)
        return response

    def _keep(
        self,
        body: ResponsesRequest,
        turn: Turn,
        response: JSON,
        session_id: str | None,
        prior: KeptResponse | None,
    ) -> None:
        if not body.store or response["status"] == "cancelled":
            return
        output = response["output"]
        self.kept.keep(
            KeptResponse(
                id=turn.id,
                session_id=session_id,
                conversation=conversation_of(
                    [] if prior is None else prior.conversation,
                    frozenset() if prior is None else prior.open_calls,
                    body.input,
                    output,
                ),
                open_calls=open_calls_of(output),
                response=response,
            )
        )

    async def _stream(
        self, turn: Turn, shape: _Shape, session_id: str | None, prior: KeptResponse | None
    ) -> AsyncIterator[str]:
        out = _Events(turn, shape)
        started = shape.envelope(turn, "in_progress", [])
        try:
            yield out.event("response.created", response=started)
            yield out.event("response.in_progress", response=started)
            try:
                async for d in turn.deltas():
                    lps = shape.logprobs(turn, d.run, d.lo, d.hi)
                    for e in out.progress(d.reasoning, d.text, lps):
                        yield e
                    if d.call is not None:  # a forced call's arguments, as they are sampled
                        for e in out.call(d.call):
                            yield e
            except Exception as exc:
                await turn.close()
                err = translate(exc)
                failed = started | {
                    "status": "failed",
                    "error": {"code": err.code or err.type, "message": err.message},
                }
                yield out.event("response.failed", response=failed)
                return
            choice = turn.choices[0]
            if choice.context_edge:
                err = context_exceeded(turn)
                failed = started | {
                    "status": "failed",
                    "error": {"code": err.code, "message": err.message},
                }
                yield out.event("response.failed", response=failed)
                return
            final = shape.choice(turn, choice)
            rest = turn.unsent_arguments(choice) or ""
            for e in out.finish(final, turn.unsent_reasoning(choice), turn.unsent(choice), rest):
                yield e
            self._keep(shape.body, turn, final, session_id, prior)
            ended = final["status"] == "incomplete"
            kind = "response.incomplete" if ended else "response.completed"
            yield out.event(kind, response=final)
        finally:
            await turn.close()


def context_exceeded(turn: Turn) -> BadRequest:
    """The error of a reply the model's context cut: OpenAI's `context_length_exceeded`, on which
    Codex compacts its history and asks again (the turn is recorded aborted: never trained)."""
    err = BadRequest(
        f"the input ({turn.prompt_tokens} tokens) left room for only {turn.completion_tokens} "
        "tokens of reply in the model's context, and the reply needed more: shorten the input "
        "(compact the conversation)",
        param="input",
    )
    err.code = "context_length_exceeded"
    return err


class _Events:
    """The item events of one streamed response, in output order: a reasoning item, a message,
    then the function calls (known only once the reply is parsed)."""

    def __init__(self, turn: Turn, shape: _Shape) -> None:
        self.seq = itertools.count()
        self.ids = {"reasoning": _item_id("rs", turn), "message": _item_id("msg", turn)}
        self.index = -1
        self.open: str | None = None
        self.closed = False
        """The reasoning item was closed (the answer's text began)."""
        self.reasoning = ""
        self.streamed: JSON | None = None
        """The function call item streaming as it is sampled (a forced call's first)."""

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _text_event(self, kind: str, item: str, **fields: Any) -> str:
        return self.event(
            kind, item_id=self.ids[item], output_index=self.index, content_index=0, **fields
        )

    def _start(self, item: str) -> list[str]:
        self.index += 1
        self.open = item
        head = {"id": self.ids[item], "status": "in_progress"}
        if item == "reasoning":
            added = {"type": "reasoning", **head, "summary": [], "content": []}
            return [self.event("response.output_item.added", output_index=self.index, item=added)]
        added = {"type": "message", **head, "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self.index, item=added),
            self._text_event("response.content_part.added", "message", part=part),
        ]

    def _close_reasoning(self, item: JSON) -> list[str]:
        self.open = None
        self.closed = True
        return [
            self._text_event("response.reasoning_text.done", "reasoning", text=self.reasoning),
            self.event("response.output_item.done", output_index=self.index, item=item),
        ]

    def progress(self, reasoning: str, text: str, lps: list[JSON]) -> list[str]:
        out: list[str] = []
        if reasoning:
            if self.open != "reasoning":
                out += self._start("reasoning")
            self.reasoning += reasoning
            out.append(
                self._text_event("response.reasoning_text.delta", "reasoning", delta=reasoning)
            )
        if text:
            if self.open == "reasoning":
                out += self._close_reasoning(_reasoning_item(self.ids["reasoning"], self.reasoning))
            if self.open != "message":
                out += self._start("message")
            out.append(
                self._text_event("response.output_text.delta", "message", delta=text, logprobs=lps)
            )
        return out

    def call(self, call: CallDelta) -> list[str]:
        """A forced call's item, opened at its first delta, and its arguments as they come."""
        out: list[str] = []
        if call.opens:
            if self.open == "reasoning":
                out += self._close_reasoning(_reasoning_item(self.ids["reasoning"], self.reasoning))
            self.index += 1
            self.streamed = {
                "type": "function_call",
                "id": f"fc_{call.id.removeprefix('call_')}",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            added = self.event(
                "response.output_item.added", output_index=self.index, item=self.streamed
            )
            out.append(added)
        assert self.streamed is not None
        at = {"item_id": self.streamed["id"], "output_index": self.index}
        return [
            *out,
            self.event("response.function_call_arguments.delta", **at, delta=call.arguments),
        ]

    def finish(
        self, final: JSON, reasoning_rest: str, text_rest: str, arguments_rest: str = ""
    ) -> list[str]:
        """The rest of the stream once the reply is whole: what is left of its text, the items
        not yet closed, and the function calls (the rest of a streamed one's arguments; one the
        reply's end did not make a call, cut by its limit, ends incomplete)."""
        out: list[str] = []
        ids = {item.get("id") for item in final["output"]}
        if self.streamed is not None and self.streamed["id"] not in ids:
            cut = self.streamed | {"status": "incomplete"}
            out.append(self.event("response.output_item.done", output_index=self.index, item=cut))
        for item in final["output"]:
            kind = item["type"]
            if kind == "reasoning":
                if self.closed:
                    continue
                if self.open != "reasoning":
                    out += self._start("reasoning")
                if reasoning_rest:
                    self.reasoning += reasoning_rest
                    out.append(
                        self._text_event(
                            "response.reasoning_text.delta", "reasoning", delta=reasoning_rest
                        )
                    )
                out += self._close_reasoning(item)
            elif kind == "message":
                if self.open != "message":
                    out += self._start("message")
                if text_rest:
                    out.append(
                        self._text_event(
                            "response.output_text.delta", "message", delta=text_rest, logprobs=[]
                        )
                    )
                part = item["content"][0]
                out += [
                    self._text_event(
                        "response.output_text.done",
                        "message",
                        text=part["text"],
                        logprobs=part["logprobs"],
                    ),
                    self._text_event("response.content_part.done", "message", part=part),
                    self.event("response.output_item.done", output_index=self.index, item=item),
                ]
                self.open = None
            elif self.streamed is not None and item["id"] == self.streamed["id"]:
                at = {"item_id": item["id"], "output_index": self.index}
                if arguments_rest:
                    out.append(
                        self.event(
                            "response.function_call_arguments.delta", **at, delta=arguments_rest
                        )
                    )
                out += [
                    self.event(
                        "response.function_call_arguments.done",
                        **at,
                        name=item["name"],
                        arguments=item["arguments"],
                    ),
                    self.event("response.output_item.done", output_index=self.index, item=item),
                ]
            else:
                self.index += 1
                added = item | {"arguments": "", "status": "in_progress"}
                at = {"item_id": item["id"], "output_index": self.index}
                out += [
                    self.event("response.output_item.added", output_index=self.index, item=added),
                    self.event(
                        "response.function_call_arguments.delta", **at, delta=item["arguments"]
                    ),
                    self.event(
                        "response.function_call_arguments.done",
                        **at,
                        name=item["name"],
                        arguments=item["arguments"],
                    ),
                    self.event("response.output_item.done", output_index=self.index, item=item),
                ]
        return out


def _item_id(prefix: str, turn: Turn) -> str:
    return f"{prefix}_{turn.id.removeprefix('resp_')}"


def _reasoning_item(item_id: str, text: str, encrypted: str | None = None) -> JSON:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": encrypted,
        "status": "completed",
    }


class _Shape:
    """A turn's choice as a Responses `response` object."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.with_logprobs = LOGPROBS_INCLUDE in (body.include or ())
        self.with_sealed = SEALED_INCLUDE in (body.include or ())

    def logprobs(self, turn: Turn, run: ChoiceRun, lo: int, hi: int) -> list[JSON]:
        if not self.with_logprobs:
            return []
        return chat_logprobs(
            turn.context.pieces, run.ids[lo:hi], run.logprobs[lo:hi], run.top_logprobs[lo:hi]
        )

    def envelope(self, turn: Turn, status: str, output: list[JSON]) -> JSON:
        b = self.body
        return {
            "id": turn.id,
            "object": "response",
            "created_at": turn.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": turn.model,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {
                "effort": (b.reasoning or {}).get("effort"),
                "summary": (b.reasoning or {}).get("summary"),
            },
            "store": b.store,
            "temperature": turn.sampling.temperature,
            "text": {"format": {"type": "text"}, **(b.text or {})},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "top_p": turn.sampling.top_p,
            "truncation": "disabled",
            "usage": None,
            "metadata": b.metadata or {},
        }

    def choice(self, turn: Turn, c: Choice) -> JSON:
        """The whole response of a finished (or aborted) choice: what is sent and recorded."""
        output: list[JSON] = []
        if c.reasoning is not None:
            sealed = seal_reasoning(c.reasoning) if self.with_sealed else None
            output.append(_reasoning_item(_item_id("rs", turn), c.reasoning, sealed))
        if c.content or not c.tool_calls:
            r = c.run
            cut = c.finish_reason in ("length", "abort")
            output.append(
                {
                    "type": "message",
                    "id": _item_id("msg", turn),
                    "status": "incomplete" if cut else "completed",
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": c.content or "",
                            "annotations": [],
                            "logprobs": self.logprobs(turn, r, 0, len(r.ids)),
                        }
                    ],
                }
            )
        for call in c.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call.id.removeprefix('call_')}",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        status = {"length": "incomplete", "abort": "cancelled"}.get(c.finish_reason, "completed")
        out = self.envelope(turn, status, output)
        if c.finish_reason == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        prompt, completion = turn.prompt_tokens, turn.completion_tokens
        out["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
            "total_tokens": prompt + completion,
        }
        return out
