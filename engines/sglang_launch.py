"""Start and supervise a local SGLang server with the flags and environment the adapter needs,
as `engines.vllm_launch` does for vLLM (`rlgateway serve --engine sglang --engine-launch`).

SGLang lives in a virtual environment of its own (it pins its own torch and CUDA kernels; there is
no CPU build on PyPI); `python` is that environment's interpreter, and the server is `python -m
sglang.launch_server`. What the adapter (`engines.sglang`) relies on needs no flag: `/generate`
takes `input_ids` and returns each sampled id with its logprob, and the weight endpoints
(`/update_weights_from_disk`, `/update_weights_from_distributed`, pause and continue) are always on;
`--grammar-backend llguidance` holds structured outputs and forced tool calls with the library the
local engine uses. One setting must not be on: `SGLANG_RETURN_ORIGINAL_LOGPROB` makes SGLang return
logprobs before the temperature, while the trainer recomputes them after it (the same distribution
as vLLM's `--logprobs-mode processed_logprobs`), so the launcher clears it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engines.launch import LaunchConfig, SupervisedServer

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


@dataclass(frozen=True, slots=True, kw_only=True)
class SGLangLaunchConfig(LaunchConfig):
    """`python` must import SGLang; `max_model_len` is its `--context-length`; `extra_args`
    more `sglang.launch_server` flags, e.g. ("--tp-size", "2")."""


def sglang_command(cfg: SGLangLaunchConfig, port: int) -> list[str]:
    cmd = [
        cfg.python,
        "-m",
        "sglang.launch_server",
        *("--model-path", cfg.model),
        *("--served-model-name", cfg.served_model_name),
        *("--host", cfg.host, "--port", str(port)),
        *("--dtype", cfg.dtype),
        # structured outputs by llguidance, as the local engine and vLLM hold them
        # (`engines.grammar`); it reads a request's `ebnf` as llguidance's Lark
        *("--grammar-backend", "llguidance"),
    ]
    if cfg.max_model_len is not None:
        cmd += ["--context-length", str(cfg.max_model_len)]
    return cmd + list(cfg.extra_args)


def sglang_env(cfg: SGLangLaunchConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ORIGINAL_LOGPROB_ENV}
    return env | {"HF_HUB_OFFLINE": "1"} | dict(cfg.env)


class SGLangServer(SupervisedServer):
    """One supervised SGLang server. `await start()`, use `url`, `await stop()`."""

    kind = "SGLang"

    def __init__(self, cfg: SGLangLaunchConfig, max_restarts: int = 3) -> None:
        super().__init__(cfg, max_restarts)
        self.cfg = cfg

    def command(self) -> list[str]:
        return sglang_command(self.cfg, self.port)

    def env(self) -> dict[str, str]:
        return sglang_env(self.cfg)
