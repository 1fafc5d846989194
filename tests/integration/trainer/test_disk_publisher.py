"""`DiskPublisher` against a real HTTP server on loopback that restarts: 502/503/504 and refused
connections are retried until `retry_seconds`, every other error is raised at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.support.gateway_server import free_port
from tests.support.live_weights import CountedWeights, LiveBucket
from trainer.publish import DiskPublisher, GatewayAdmin
from trainer.weights import StateDictWeights


class Flaky:
    """A gateway whose first `failures` answers to GET /admin/version are `status`."""

    def __init__(self, failures: int, status: int) -> None:
        self.failures = failures
        self.status = status
        self.calls = 0
        self.app = FastAPI()
        self.app.get("/admin/version")(self.version)

    async def version(self) -> JSONResponse:
        self.calls += 1
        if self.calls <= self.failures:
            return JSONResponse({"error": "restarting"}, status_code=self.status)
        return JSONResponse({"version": 7})


@asynccontextmanager
async def serve(app: FastAPI, port: int) -> AsyncIterator[uvicorn.Server]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


def publisher(tmp_path: Path, port: int, retry_seconds: float) -> DiskPublisher:
    admin = GatewayAdmin(f"http://127.0.0.1:{port}", "t", retry_seconds=retry_seconds)
    return DiskPublisher(tmp_path / "weights", tmp_path / "model", admin)


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_a_restarting_gateway_is_retried_until_it_answers(
    tmp_path: Path, status: int
) -> None:
    port = free_port()
    flaky = Flaky(failures=2, status=status)
    async with serve(flaky.app, port):
        assert await publisher(tmp_path, port, retry_seconds=30).served() == 7
    assert flaky.calls == 3


async def test_a_gateway_that_comes_up_late_is_waited_for(tmp_path: Path) -> None:
    port = free_port()
    flaky = Flaky(failures=0, status=200)
    asking = asyncio.create_task(publisher(tmp_path, port, retry_seconds=30).served())
    await asyncio.sleep(1.2)  # refused connections meanwhile
    assert not asking.done()
    async with serve(flaky.app, port):
        assert await asking == 7


async def test_a_gateway_still_down_at_the_deadline_is_an_error_naming_the_last_failure(
    tmp_path: Path,
) -> None:
    port = free_port()
    flaky = Flaky(failures=100, status=503)
    async with serve(flaky.app, port):
        with pytest.raises(ConnectionError, match=r"within 2 s \(last: 503"):
            await publisher(tmp_path, port, retry_seconds=2).served()
    assert 2 <= flaky.calls <= 4


async def test_any_other_error_is_raised_at_once(tmp_path: Path) -> None:
    import httpx

    port = free_port()
    flaky = Flaky(failures=1, status=409)
    async with serve(flaky.app, port):
        with pytest.raises(httpx.HTTPStatusError, match="409"):
            await publisher(tmp_path, port, retry_seconds=30).served()
    assert flaky.calls == 1


@pytest.mark.parametrize("keep", [1, 2])
async def test_the_newest_keep_versions_stay_on_disk(tmp_path: Path, keep: int) -> None:
    """`publish.keep`: each version is written as `v{N}` and announced; older ones go."""
    import torch

    announced: list[dict[str, object]] = []
    app = FastAPI()

    @app.post("/admin/weights")
    async def load(body: dict[str, object]) -> JSONResponse:
        announced.append(body)
        return JSONResponse({"version": body["version"], "changed": True})

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    port = free_port()
    async with serve(app, port):
        admin = GatewayAdmin(f"http://127.0.0.1:{port}", "t", retry_seconds=5)
        pub = DiskPublisher(tmp_path / "weights", tmp_path / "model", admin, keep=keep)
        for v in (1, 2, 3):
            assert await pub.publish(StateDictWeights({"w": torch.full((2,), float(v))}), v) == v
    assert [b["version"] for b in announced] == [1, 2, 3]
    kept = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert kept == ["v1", "v2", "v3"][-keep:]
    assert sorted(p.name for p in (tmp_path / "weights" / "v3").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.parametrize("bucket_mb", [512.0, 0.5])
async def test_publish_bucket_mb_sets_the_files_a_version_is_written_in(
    tmp_path: Path, tiny_model: Path, bucket_mb: float
) -> None:
    """`publish.bucket_mb`: one safetensors file per bucket, written as it comes (with the
    index transformers and vLLM read where there are several); the model loads the same."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engines.weights import read_dir
    from trainer.config import PublishConfig
    from trainer.weights import buckets_of

    app = FastAPI()

    @app.post("/admin/weights")
    async def load(body: dict[str, object]) -> JSONResponse:
        return JSONResponse({"version": body["version"], "changed": True})

    state = load_file(str(tiny_model / "model.safetensors"))
    bucket_bytes = PublishConfig(bucket_mb=bucket_mb).bucket_bytes
    port = free_port()
    async with serve(app, port):
        admin = GatewayAdmin(f"http://127.0.0.1:{port}", "t", retry_seconds=5)
        pub = DiskPublisher(tmp_path / "w", tiny_model, admin, bucket_bytes=bucket_bytes)
        LiveBucket.most = 0
        assert await pub.publish(CountedWeights(state), 1) == 1
        assert LiveBucket.most == 1  # each bucket written as it comes
    out = tmp_path / "w" / "v1"
    files = len(buckets_of(StateDictWeights(state).metas(), bucket_bytes))
    assert files == (1 if bucket_mb == 512.0 else 4)  # the 1.8 MiB tiny model
    assert len(list(out.glob("*.safetensors"))) == files
    assert (out / "model.safetensors.index.json").is_file() == (files > 1)
    on_disk = read_dir(out)
    assert on_disk.keys() == state.keys()
    assert all(torch.equal(on_disk[k], state[k]) for k in state)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)
