"""Request schemas of the OpenAI routes. Valid OpenAI fields the gateway does not use are accepted
(extra="allow") and ignored; vLLM's common extensions (top_k, min_tokens, stop_token_ids,
ignore_eos) are honoured.

Types are strict where OpenAI's API is (a boolean is `true` or `false`, not `"yes"` or `1`; a
count is an integer, not `false` or `"2"`), and every number that reaches an engine is bounded:
a field out of range is a 422 naming it and its limit. The body as a whole passes
`gateway.limits.check_json` first (UTF-8 text, finite numbers: else a 400 naming the field), and
what needs several fields is checked here too (prompts x n, tool results answer tool calls).
`check_vocab` holds what needs the model's vocabulary, which a schema does not know.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from engines.base import MAX_TOP_LOGPROBS
from gateway.core.formats import format_schema
from gateway.core.sampling import Asked
from gateway.errors import BadRequest, invalid_input
from gateway.limits import (
    MAX_GENERATIONS,
    MAX_INT32,
    CheckedBody,
    Int,
    Num,
    TemplateVariables,
    TokenCount,
    TokenId,
)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """An assistant message's reasoning, as the gateway (and vLLM) return it."""


class ToolFunction(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Open):
    include_usage: StrictBool = False


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
"""vLLM's constrained-decoding extensions."""


class _Sampling(_Open, CheckedBody):
    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_GENERATIONS)
    temperature: Num | None = Field(None, ge=0.0, le=2.0)
    top_p: Num | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=MAX_INT32)
    """-1 or 0: off; a k at or above the vocabulary keeps every token."""
    min_tokens: Int = Field(0, ge=0, le=MAX_INT32)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    """Within the model's vocabulary (`check_vocab`)."""
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    """`text`, `json_object` or `json_schema`: the reply is held to the schema by
    grammar-constrained decoding (`engines.grammar`)."""
    _json_schema: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _structured_output(self) -> Self:
        self._json_schema = format_schema(self.response_format, "response_format", nested=True)
        for name in _GUIDED:
            if (self.model_extra or {}).get(name) is not None:
                raise invalid_input(
                    f"{name} is not served: ask for JSON with response_format (json_schema or "
                    "json_object), which the reply is held to",
                    name,
                )
        return self

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def asked(self, max_new_tokens: int | None, top_logprobs: int) -> Asked:
        """The sampling this request asks for (`gateway.core.sampling`)."""
        return Asked(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            max_new_tokens=max_new_tokens,
            top_logprobs=top_logprobs,
            json_schema=self._json_schema,
        )


class ChatCompletionRequest(_Sampling, TemplateVariables):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    """False: one tool call at most (the reply stops at the end of its first)."""

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> Self:
        """A tool message answers a call of the assistant message just before it (only other tool
        results between), by that call's id: as OpenAI requires, and what a chat template needs
        to render it as the result of that call."""
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                calls = {c.id for c in m.tool_calls or () if c.id is not None}
            elif m.role != "tool":
                calls = set()
            elif m.tool_call_id not in calls:
                where = f"messages.{i}.tool_call_id"
                raise invalid_input(
                    f"{where}: a tool message must answer a tool call of the assistant message "
                    f"before it, by its id; {m.tool_call_id!r} is none of "
                    f"{sorted(calls) or 'them (there are no tool calls to answer)'}",
                    where,
                )
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: TokenCount | None = 16
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    @model_validator(mode="after")
    def _bounded_generations(self) -> Self:
        p = self.prompt
        prompts = 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)
        if prompts * self.n > MAX_GENERATIONS:
            raise invalid_input(
                f"prompt: {prompts} prompts x n={self.n} would be {prompts * self.n} "
                f"generations; a request makes at most {MAX_GENERATIONS}: send fewer prompts per "
                "request",
                "prompt",
            )
        return self


class Model(BaseModel):
    """One model the gateway serves (OpenAI's model object)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    """When this answer was made (Unix seconds): the gateway serves whatever its engines hold."""
    owned_by: str = "rlgateway"
    parsers: dict[str, str] = {}
    """How replies are read (an rlgateway field): the tool-call parser (`unknown`: the chat
    template's format is not one the gateway knows, so tool calls are refused) and the reasoning
    parser."""


class ModelList(BaseModel):
    """`GET /v1/models`: the one model the gateway's engines serve."""

    object: Literal["list"] = "list"
    data: list[Model]


def check_vocab(body: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> None:
    """BadRequest when `stop_token_ids` hold an id outside the model's vocabulary [0,
    vocab_size): such an id can never be sampled, and a remote engine may refuse it."""
    for i, t in enumerate(body.stop_token_ids or ()):
        if t >= vocab_size:
            raise BadRequest(
                f"stop_token_ids.{i} is {t}, outside the vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )
