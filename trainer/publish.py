"""Publishing new weights to the inference engines: one interface, several transports.

A publisher gets `trainer.weights.Weights`: names, dtypes and shapes up front, the tensors a
bucket at a time, gathered from the trainer's shards as each bucket is read (never the whole model
on one rank, where the transport allows it).

- `LocalPublisher`: the engine lives in this process (`rlgateway serve --train`, one trainer
  rank): the state dict goes straight to `engine.update_weights`, applied between decode steps;
  the engine's swap takes every tensor at once, so the buckets are collected first.
- `DiskPublisher`: the gateway runs in another process: the weights are written as a HF
  safetensors directory, one file per bucket as it comes, and the gateway is told to load them
  (`POST /admin/weights`).
- `trainer.collective.CollectivePublisher`: the engines are vLLM/SGLang servers: the weights
  are broadcast over a process group the servers join (no shared filesystem), bucket by bucket,
  a version that fails that way going through one of the above.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Protocol

from engines.base import Engine, WeightUpdate
from engines.weights import save_shards
from trainer.torch_thread import on_torch_thread
from trainer.weights import Weights, gather_all


class WeightPublisher(Protocol):
    async def publish(self, weights: Weights, version: int) -> int:
        """Make `version` the engines' policy; returns the version they now serve. Publishing
        the version they already serve changes nothing (a restarted trainer's resume)."""
        ...

    async def served(self) -> int:
        """The policy version the engines serve now."""
        ...


class LocalPublisher:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def publish(self, weights: Weights, version: int) -> int:
        if version == self.engine.version():
            return version
        state_dict = await on_torch_thread(gather_all, weights)
        return await self.engine.update_weights(
            WeightUpdate(state_dict=state_dict, version=version)
        )

    async def served(self) -> int:
        return self.engine.version()


class GatewayAdmin:
    """The gateway's admin API at `url`, as a trainer calls it. A gateway that is down or
    restarting (connection refused, 502/503/504) is retried with backoff for up to
    `retry_seconds` where a call may be repeated, so a trainer rides out a gateway restart at the
    same address."""

    def __init__(self, url: str, token: str, retry_seconds: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.retry_seconds = retry_seconds

    async def call(
        self,
        method: str,
        path: str,
        json: dict[str, object] | None = None,
        *,
        read_s: float = 600.0,
        retry: bool = True,
    ) -> dict[str, object]:
        """The JSON answer; `httpx.HTTPStatusError` for a 4xx/5xx, `ConnectionError` once the
        retries (none with `retry=False`) are spent."""
        import time

        import httpx

        deadline = time.monotonic() + (self.retry_seconds if retry else 0.0)
        delay = 0.5
        headers = {"Authorization": f"Bearer {self.token}"}
        while True:
            try:
                async with httpx.AsyncClient(timeout=read_s) as http:
                    r = await http.request(method, f"{self.url}{path}", headers=headers, json=json)
                if r.status_code not in (502, 503, 504) or not retry:
                    r.raise_for_status()
                    body: dict[str, object] = r.json()
                    return body
                failure = f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise ConnectionError(
                    f"the gateway at {self.url} did not answer {method} {path}"
                    + (f" within {self.retry_seconds:.0f} s" if retry else "")
                    + f" (last: {failure})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def served(self) -> int:
        body = await self.call("GET", "/admin/version")
        return int(str(body["version"]))


class DiskPublisher:
    """Writes `dir/v{version}`, a safetensors file per bucket of at most `bucket_bytes`, and asks
    the gateway (`admin`) to load it (`POST /admin/weights`); the gateway must see this machine's
    filesystem. The newest `keep` versions stay on disk."""

    def __init__(
        self,
        directory: Path,
        model_dir: Path,
        admin: GatewayAdmin,
        keep: int = 2,
        bucket_bytes: int = 512 << 20,
    ) -> None:
        self.directory = directory
        self.model_dir = model_dir
        self.admin = admin
        self.keep = keep
        self.bucket_bytes = bucket_bytes

    async def publish(self, weights: Weights, version: int) -> int:
        out = self.directory / f"v{version}"
        shards = weights.buckets(self.bucket_bytes)
        await on_torch_thread(save_shards, shards, out, self.model_dir)
        body = await self.admin.call(
            "POST", "/admin/weights", json={"path": str(out.resolve()), "version": version}
        )
        for old in sorted(self.directory.glob("v*"), key=lambda p: int(p.name[1:]))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return int(str(body["version"]))

    async def served(self) -> int:
        return await self.admin.served()
