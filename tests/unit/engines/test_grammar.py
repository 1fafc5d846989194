"""Grammar-constrained decoding in the local engine (`engines.grammar`, `engines.constraint`): the
random tiny model, which writes arbitrary bytes unconstrained, returns JSON valid against the
schema; each token's behaviour logprob is the masked distribution's, as an independent
teacher-forced pass with the same masks computes it; a schema the compiler refuses is a clear
`InvalidRequestError` before anything is sampled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from engines.base import FinishReason, GenerateRequest, SamplingParams
from engines.constraint import Grammars
from engines.errors import InvalidRequestError
from engines.grammar import JSON_OBJECT_SCHEMA, GrammarError, check_json_schema
from engines.local import LocalEngine
from engines.tiny_model import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "word": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["ok", "word", "n", "kind"],
    "additionalProperties": False,
}


async def generate(engine: LocalEngine, prompt: list[int], sp: SamplingParams) -> Any:
    ids: list[int] = []
    lps: list[float] = []
    finish = None
    async for chunk in engine.generate(GenerateRequest(prompt_ids=tuple(prompt), sampling=sp)):
        ids += chunk.token_ids
        lps += chunk.logprobs
        finish = chunk.finish_reason
    return ids, lps, finish


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_the_reply_is_json_valid_against_the_schema(
    shared_engine: LocalEngine, tiny_model: Path, temperature: float
) -> None:
    tok = load_tokenizer(tiny_model)
    schema = json.dumps(SCHEMA)
    for seed in range(4):
        sp = SamplingParams(
            temperature=temperature, seed=seed, max_new_tokens=80, json_schema=schema
        )
        ids, _, finish = await generate(shared_engine, tok.encode("hello"), sp)
        assert finish is FinishReason.STOP
        assert ids[-1] in shared_engine.eos_token_ids  # the end token follows the complete JSON
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)


async def test_unconstrained_the_tiny_model_writes_no_json(
    shared_engine: LocalEngine, tiny_model: Path
) -> None:
    """The control: the same requests without the schema are not JSON."""
    tok = load_tokenizer(tiny_model)
    for seed in range(4):
        sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=40)
        ids, _, _ = await generate(shared_engine, tok.encode("hello"), sp)
        with pytest.raises(json.JSONDecodeError):
            json.loads(tok.decode(ids, skip_special_tokens=True))


async def test_json_mode_gives_an_object(shared_engine: LocalEngine, tiny_model: Path) -> None:
    tok = load_tokenizer(tiny_model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=200, json_schema=JSON_OBJECT_SCHEMA)
    ids, _, finish = await generate(shared_engine, tok.encode("hi"), sp)
    if finish is FinishReason.STOP:
        assert isinstance(json.loads(tok.decode(ids[:-1])), dict)
    else:  # an open-ended object may run out of tokens; what came is still a JSON prefix
        assert tok.decode(ids).startswith("{")


async def test_the_behaviour_logprob_is_the_masked_distributions(
    shared_engine: LocalEngine, tiny_model: Path, reference: Any
) -> None:
    """Teacher-forced: the reference model's logits at each output position, masked by a fresh
    matcher replaying the output, give the recorded logprob; unmasked they give less (the mask
    only concentrates probability), and a token the grammar forces has logprob 0."""
    tok = load_tokenizer(tiny_model)
    prompt = tok.encode("hello")
    schema = json.dumps(SCHEMA)
    sp = SamplingParams(temperature=0.8, seed=3, max_new_tokens=80, json_schema=schema)
    ids, lps, _ = await generate(shared_engine, prompt, sp)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ids])).logits[0].float()
    grammar = Grammars(tiny_model, logits.shape[-1]).matcher(schema, None)
    assert grammar is not None
    stops = frozenset(shared_engine.eos_token_ids)
    forced = 0
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        row = logits[len(prompt) - 1 + i] / 0.8
        allow = grammar.allowed(stops)
        masked = torch.log_softmax(row.masked_fill(~allow, -torch.inf), -1)[t]
        assert lp == pytest.approx(float(masked), abs=1e-4)
        assert lp >= float(torch.log_softmax(row, -1)[t]) - 1e-5
        if int(allow.sum()) == 1:
            forced += 1
            assert lp == pytest.approx(0.0, abs=1e-6)
        if t not in stops:
            grammar.accept(t)
    assert forced > 0  # e.g. the quotes and keys of a strict schema


async def test_without_end_tokens_the_reply_stops_where_the_json_is_complete(
    shared_engine: LocalEngine, tiny_model: Path
) -> None:
    tok = load_tokenizer(tiny_model)
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    )
    sp = SamplingParams(
        temperature=1.0, seed=1, max_new_tokens=40, json_schema=schema, ignore_eos=True
    )
    ids, _, finish = await generate(shared_engine, tok.encode("x"), sp)
    assert finish is FinishReason.STOP
    assert json.loads(tok.decode(ids)) in ({"a": True}, {"a": False})


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"type": "strin"}', "strin"),
    ],
)
async def test_a_schema_that_does_not_compile_is_refused_before_sampling(
    shared_engine: LocalEngine, schema: str, says: str
) -> None:
    with pytest.raises(GrammarError, match=says):
        check_json_schema(schema)
    request = GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams(json_schema=schema))
    with pytest.raises(InvalidRequestError, match=says):
        shared_engine.check(request)
    health = await shared_engine.health()
    assert health.ok  # the engine goes on
