"""Publishing new weights to the inference engines: one interface, several transports.

- `LocalPublisher`: the engine lives in this process (`rlgateway serve --train`): the state dict
  goes straight to `engine.update_weights`, applied between decode steps.
- `DiskPublisher`: the gateway runs in another process: the weights are written as a HF
  safetensors directory and the gateway is told to load them (`POST /admin/weights`).
- An NCCL transport (for vLLM/SGLang on GPUs) implements the same `publish` with a broadcast.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

import torch

from engines.base import Engine, WeightUpdate


class WeightPublisher(Protocol):
    async def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Make `version` the engines' policy; returns the version they now serve. Publishing
        the version they already serve changes nothing (a restarted trainer's resume)."""
        ...

    async def served(self) -> int:
        """The policy version the engines serve now."""
        ...


class LocalPublisher:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        if version == self.engine.version():
            return version
        return await self.engine.update_weights(
            WeightUpdate(state_dict=state_dict, version=version)
        )

    async def served(self) -> int:
        return self.engine.version()


def save_weights(state_dict: dict[str, torch.Tensor], model_dir: Path, out: Path) -> None:
    """A loadable HF directory: the base model's config/tokenizer files plus new weights."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, tmp / f.name)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


class DiskPublisher:
    """Writes `dir/v{version}` and asks the gateway at `gateway_url` to load it. A gateway that
    is down or restarting (connection refused, 502/503/504) is retried with backoff for up to
    `retry_seconds`, so a trainer rides out a gateway restart at the same address."""

    def __init__(
        self,
        directory: Path,
        model_dir: Path,
        gateway_url: str,
        admin_token: str,
        keep: int = 2,
        retry_seconds: float = 120.0,
    ) -> None:
        self.directory = directory
        self.model_dir = model_dir
        self.gateway_url = gateway_url.rstrip("/")
        self.admin_token = admin_token
        self.keep = keep
        self.retry_seconds = retry_seconds

    async def _call(
        self, method: str, path: str, json: dict[str, object] | None = None
    ) -> dict[str, object]:
        import asyncio
        import time

        import httpx

        deadline = time.monotonic() + self.retry_seconds
        delay = 0.5
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        while True:
            try:
                async with httpx.AsyncClient(timeout=600) as http:
                    r = await http.request(
                        method, f"{self.gateway_url}{path}", headers=headers, json=json
                    )
                if r.status_code not in (502, 503, 504):
                    r.raise_for_status()
                    body: dict[str, object] = r.json()
                    return body
                failure = f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise ConnectionError(
                    f"the gateway at {self.gateway_url} did not answer {method} {path} within "
                    f"{self.retry_seconds:.0f} s (last: {failure})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        import asyncio

        out = self.directory / f"v{version}"
        await asyncio.to_thread(save_weights, state_dict, self.model_dir, out)
        body = await self._call(
            "POST", "/admin/weights", json={"path": str(out.resolve()), "version": version}
        )
        for old in sorted(self.directory.glob("v*"), key=lambda p: int(p.name[1:]))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return int(str(body["version"]))

    async def served(self) -> int:
        body = await self._call("GET", "/admin/version")
        return int(str(body["version"]))
