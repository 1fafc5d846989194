"""Forced tool calls held to the tools' schemas (`gateway.core.tool_grammars`), on the local engine
and the random tiny model: for every parser with a grammar, the prefill plus what the engine
samples under the grammar parses into calls of declared tools whose arguments validate against
their tool's `parameters`, for a named tool and for `required`, one call or several. The control:
the prefill alone (the behaviour before grammars) gives the untrained model's noise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engines.base import FinishReason, GenerateRequest, SamplingParams
from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer
from gateway.core.call_stream import first_call_so_far
from gateway.core.tool_parsers import TOOL_PARSERS, ToolCallParser

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"$ref": "#/$defs/short"}},
    "required": ["text"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 5}},
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "take_note", "parameters": NOTE}},
]
SCHEMAS = {"get_weather": WEATHER, "take_note": NOTE}
HELD = [name for name, cls in TOOL_PARSERS.items() if cls().grammar(TOOLS, None, True, {})]


def marks(model: Path) -> dict[str, int]:
    """The tokenizer's added tokens, as the gateway passes them."""
    added = load_tokenizer(model).added_tokens_decoder
    return {t.content: i for i, t in added.items()}


async def sample(engine: LocalEngine, model: Path, prefill: str, sp: SamplingParams) -> Any:
    tok = load_tokenizer(model)
    ids: list[int] = []
    finish = None
    prompt = tuple(tok.encode("call a tool" + prefill))
    async for chunk in engine.generate(GenerateRequest(prompt_ids=prompt, sampling=sp)):
        ids += chunk.token_ids
        finish = chunk.finish_reason
    return tok.decode(ids, skip_special_tokens=True), finish


def check_calls(parser: ToolCallParser, text: str, name: str | None) -> int:
    _, calls = parser.parse(text, TOOLS)
    assert calls, text
    for call in calls:
        assert call.name == name if name is not None else call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return len(calls)


def test_every_parser_has_a_grammar() -> None:
    """The keyed formats (qwen3_coder, glm45, minimax_m2) and Python literals (llama4_pythonic)
    are held by the tools' properties; a Python-literal tool whose property JSON cannot write as
    Python (an object) is forced by the prefill alone."""
    assert set(TOOL_PARSERS) == set(HELD)
    untyped = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"o": {"type": "object"}}},
            },
        }
    ]
    assert TOOL_PARSERS["llama4_pythonic"]().grammar(untyped, "f", True, {}) is None


@pytest.mark.parametrize("parser_name", HELD)
@pytest.mark.parametrize("name", [None, "get_weather", "take_note"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one"])
async def test_a_forced_call_is_a_call_of_a_declared_tool_with_valid_arguments(
    shared_engine: LocalEngine, tiny_model: Path, parser_name: str, name: str | None, parallel: bool
) -> None:
    parser = TOOL_PARSERS[parser_name]()
    prefill = parser.prefill(name)
    grammar = parser.grammar(TOOLS, name, parallel, marks(tiny_model))
    counts = []
    for seed in range(3):
        sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=1500, grammar=grammar)
        text, finish = await sample(shared_engine, tiny_model, prefill, sp)
        assert finish is FinishReason.STOP, text
        counts.append(check_calls(parser, prefill + text, name))
    if name is not None or not parallel or parser_name == "llama3_json":  # one call
        assert counts == [1, 1, 1]


@pytest.mark.parametrize("parser_name", HELD)
async def test_the_prefill_alone_does_not_hold_the_arguments(
    shared_engine: LocalEngine, tiny_model: Path, parser_name: str
) -> None:
    """The control: the untrained model after the prefill alone writes no valid call."""
    parser = TOOL_PARSERS[parser_name]()
    prefill = parser.prefill("get_weather")
    for seed in range(3):
        sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=60)
        text, _ = await sample(shared_engine, tiny_model, prefill, sp)
        _, calls = parser.parse(prefill + text, TOOLS)
        assert not calls or not all(_valid(c.arguments) for c in calls)


def _valid(arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), WEATHER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_a_tool_schema_that_cannot_be_held_is_refused_by_name() -> None:
    from engines.grammar import GrammarError, lark_grammar

    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    with pytest.raises(GrammarError):
        lark_grammar(TOOL_PARSERS["hermes"]().grammar(bad, "f", True, {}))


STREAMED = [n for n in HELD if TOOL_PARSERS[n]().json_arguments]


@pytest.mark.parametrize("parser_name", STREAMED)
@pytest.mark.parametrize("name", [None, "get_weather"])
async def test_a_forced_calls_first_call_reads_as_it_streams(
    shared_engine: LocalEngine, tiny_model: Path, parser_name: str, name: str | None
) -> None:
    """What a stream sends of a forced call before the reply ends (`call_stream`): the reply
    starts as the parser's prefill for one tool's name, and the object after it, read at every
    token, grows into the arguments the parser reads at the end."""
    parser = TOOL_PARSERS[parser_name]()
    prefill = parser.prefill(name)
    grammar = parser.grammar(TOOLS, name, True, marks(tiny_model))
    sp = SamplingParams(temperature=1.0, seed=5, max_new_tokens=1500, grammar=grammar)
    text, _ = await sample(shared_engine, tiny_model, prefill, sp)
    names = [name] if name else list(SCHEMAS)
    _, [first, *_] = parser.parse(prefill + text, TOOLS)
    seen = [first_call_so_far(prefill + text[:k], names, parser.prefill) for k in range(len(text))]
    grown = [s[1] for s in seen if s is not None]
    assert grown
    assert all(a.startswith(b) for a, b in zip(grown[1:], grown, strict=False))
    final = first_call_so_far(prefill + text, names, parser.prefill)
    assert final is not None
    assert (final[0], json.loads(final[1])) == (first.name, json.loads(first.arguments))
