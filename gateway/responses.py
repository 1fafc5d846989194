"""`/v1/responses` on the turn core (`gateway.turn`): a Responses request to a `TurnSpec`, and a
turn's choice to a `response` object or its documented event stream.

`previous_response_id` continues the conversation of a kept response (`gateway.kept_responses`):
its messages come first, so the request extends the same segment token for token, exactly as a
client that sends the whole history again (`store: false`) does. The stream is
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
(for a message) `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, (for a function call)
`response.function_call_arguments.delta` and `.done`, then `response.output_item.done`, and last
`response.completed` (`response.incomplete` when it stopped at `max_output_tokens`), or
`response.failed` when the engine fails after the stream began. Every event carries its
`sequence_number`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.chat_render import named_prefill, required_prefill
from gateway.choices import EventStream, chat_logprobs
from gateway.errors import BadRequest, NotFound, translate
from gateway.kept_responses import KeptResponse, KeptResponses, conversation_of, open_calls_of
from gateway.responses_types import ResponsesRequest, input_messages, tool_choice_of, tools_of
from gateway.sampling import Asked
from gateway.turn import ChatPrompt, Choice, Turn, TurnCore, TurnSpec
from store.run_config import RunConfig
from store.types import JSON

LOGPROBS_INCLUDE = "message.output_text.logprobs"


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
    ) -> dict[str, Any] | EventStream:
        """The response (JSON), or for `stream` its events, once the first piece was generated
        (`TurnCore.start`)."""
        prior = await self._prior(body, session_id)
        tools = tools_of(body.tools).callable
        mode, name = tool_choice_of(body.tool_choice, {t["function"]["name"] for t in tools})
        messages = input_messages(
            body.input, open_calls=frozenset() if prior is None else prior.open_calls
        )
        history = [] if prior is None else prior.conversation
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        if not messages and not history:
            raise BadRequest("input is empty: send a string or at least one item", param="input")
        prefill = named_prefill(name) if mode == "named" else ""
        prefill = required_prefill() if mode == "required" else prefill
        spec = TurnSpec(
            protocol="responses",
            id_prefix="resp_",
            prompts=[ChatPrompt([*system, *history, *messages], tools, prefill, mode != "none")],
            asked=Asked(
                temperature=body.temperature,
                top_p=body.top_p,
                max_new_tokens=body.max_output_tokens,
                top_logprobs=body.top_logprobs or 0,
            ),
            stream=body.stream,
            request=body.model_dump(mode="json", exclude_none=True),
            cap_to_context=True,
        )
        shape = _Shape(body)
        turn = await self.core.start(spec, session_id, run=run, retry=retry, respond=shape.choice)
        if body.stream:
            return EventStream(self._stream(turn, shape, session_id, prior), turn.close)
        choice = (await turn.complete())[0]
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
                session_id=session_id if turn.core.recorder is not None else None,
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
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            body = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        started = shape.envelope(turn, "in_progress", [])
        msg_id = _message_id(turn)
        opened = False
        logprobs: list[JSON] = []

        def open_message() -> list[str]:
            item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [
                event("response.output_item.added", output_index=0, item=item | {"content": []}),
                event(
                    "response.content_part.added",
                    item_id=msg_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
            ]

        def text_delta(text: str, lps: list[JSON]) -> str:
            return event(
                "response.output_text.delta",
                item_id=msg_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=lps,
            )

        try:
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            try:
                async for d in turn.deltas():
                    lps = shape.logprobs(turn, d.run.ids[d.lo : d.hi], d.lo, d.hi, d.run)
                    logprobs.extend(lps)
                    if not d.text:
                        continue
                    if not opened:
                        for e in open_message():
                            yield e
                        opened = True
                    yield text_delta(d.text, lps)
            except Exception as exc:
                await turn.close()
                err = translate(exc)
                failed = started | {
                    "status": "failed",
                    "error": {"code": err.code or err.type, "message": err.message},
                }
                yield event("response.failed", response=failed)
                return
            choice = turn.choices[0]
            final = shape.choice(turn, choice)
            for index, item in enumerate(final["output"]):
                if item["type"] == "message":
                    if not opened:
                        for e in open_message():
                            yield e
                    if rest := turn.unsent(choice):
                        yield text_delta(rest, [])
                    part = item["content"][0]
                    yield event(
                        "response.output_text.done",
                        item_id=msg_id,
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                    yield event(
                        "response.content_part.done",
                        item_id=msg_id,
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                else:
                    added = item | {"arguments": "", "status": "in_progress"}
                    yield event("response.output_item.added", output_index=index, item=added)
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                yield event("response.output_item.done", output_index=index, item=item)
            self._keep(shape.body, turn, final, session_id, prior)
            ended = final["status"] == "incomplete"
            yield event("response.incomplete" if ended else "response.completed", response=final)
        finally:
            await turn.close()


def _message_id(turn: Turn) -> str:
    return f"msg_{turn.id.removeprefix('resp_')}"


class _Shape:
    """A turn's choice as a Responses `response` object."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.with_logprobs = LOGPROBS_INCLUDE in (body.include or ())

    def logprobs(self, turn: Turn, ids: list[int], lo: int, hi: int, run: Any) -> list[JSON]:
        if not self.with_logprobs:
            return []
        return chat_logprobs(turn.core.pieces, ids, run.logprobs[lo:hi], run.top_logprobs[lo:hi])

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
            "model": turn.core.model_name,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": turn.sampling.temperature,
            "text": {"format": {"type": "text"}},
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
        if c.content or not c.tool_calls:
            r = c.run
            cut = c.finish_reason in ("length", "abort")
            output.append(
                {
                    "type": "message",
                    "id": _message_id(turn),
                    "status": "incomplete" if cut else "completed",
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": c.content or "",
                            "annotations": [],
                            "logprobs": self.logprobs(turn, r.ids, 0, len(r.ids), r),
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
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
        return out
