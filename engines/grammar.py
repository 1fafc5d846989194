"""Grammar-constrained decoding: a JSON schema held over every sampled token, with llguidance.

A request's `SamplingParams.json_schema` (JSON text; `{"type": "object"}` is JSON mode), or its
`SamplingParams.grammar` (llguidance's Lark dialect: a forced tool call), is compiled against the
model's tokenizer into a matcher; before each draw the matcher says which
tokens may come next, and every other token's logit is set to -inf. The behaviour logprob is then
the masked distribution's, `log_softmax(masked logits / T)`: what the token was really drawn from,
and what vLLM and SGLang report for a constrained request (their grammar mask is applied to the
logits before their sampler computes logprobs). How the trainer trains such tokens is the
sampling contract's (`store.run_config`, "Constrained turns").

Why llguidance (over xgrammar, which vLLM and SGLang also use): one small wheel with no
dependencies (xgrammar's pulls triton and a TVM runtime into a CPU install), masks computed
lazily per token in tens of microseconds with no per-schema precompilation pass, and JSON
schema coverage broad enough for OpenAI's strict mode and beyond; vLLM serves it as its `guidance`
backend. Whitespace is compact (no free whitespace between tokens): a model, trained or not, can
then not spend its budget on blank space, and the reply is the JSON a client parses.

End of output: the model's end tokens (the request's stop ids) may be sampled only where the JSON
is complete; once the grammar admits nothing more, only they may.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import llguidance

from engines.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""The schema of JSON mode (`response_format: json_object`): any JSON object."""

_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(InvalidRequestError):
    """The schema cannot be compiled: the message is the compiler's."""


@functools.lru_cache(maxsize=256)
def json_grammar(schema: str) -> str:
    """llguidance's grammar for JSON valid against `schema` (JSON text); `GrammarError` when the
    schema is not JSON or not one the compiler supports."""
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise GrammarError("the JSON schema must be a JSON object")
    try:
        grammar: str = llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the JSON schema cannot be used: {error}")
    return grammar


def check_json_schema(schema: str) -> None:
    """Raise `GrammarError` unless `schema` compiles (no tokenizer needed)."""
    json_grammar(schema)


@functools.lru_cache(maxsize=256)
def lark_grammar(grammar: str) -> str:
    """`grammar` (llguidance's Lark dialect) when it compiles, else `GrammarError`."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the grammar cannot be used: {error}")
    return grammar


def constraint_grammar(json_schema: str | None, grammar: str | None) -> str | None:
    """What a request's output is held to, compiled (None: nothing); `GrammarError` when it does
    not compile. The arguments are `SamplingParams.json_schema` and `.grammar`."""
    if json_schema is not None:
        return json_grammar(json_schema)
    return None if grammar is None else lark_grammar(grammar)


def schema_of(value: Any) -> str:
    """A schema given as an object or as JSON text, as JSON text."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
