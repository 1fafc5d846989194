"""Service settings: flags or environment variables prefixed `RLGATEWAY_`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""The engine dtypes `rlgateway serve --dtype` and an experiment's `engine.dtype` take."""


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLGATEWAY_", extra="ignore")

    database_url: str = "sqlite:///rlgateway.db"
    """Where trajectories go: sqlite:///PATH (default ./rlgateway.db) or postgresql://..."""
    admin_token: str | None = None
    """Bearer token for /runs and admin calls. `rlgateway serve` makes one up (and prints it)
    when unset; set it for anything but a local trial."""
    model: str | None = None
    """A Hugging Face model directory; unset means the tiny model (built on first use)."""
    served_model_name: str | None = None
    """The name /v1/models reports; defaults to the model directory's name."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    public_url: str | None = None
    """How agents reach this gateway (for the base_url of new sessions); default http://host:port."""
    device: str | None = None
    """cpu or cuda for the local engine; default: cuda when present."""
    dtype: EngineDtype = "auto"
    """The engine's weights, KV cache and activations: the local engine's (auto: float32 on a CPU,
    bfloat16 on CUDA) or a launched vLLM/SGLang server's (`--dtype`, auto: theirs). Logprobs
    are taken in float32 from the logits either way. On a CPU with AVX512-BF16 or AMX, bfloat16
    decodes 1.2-1.5x as fast as float32 (BENCHMARKS.md) with behaviour logprobs 0.03-0.05 off
    the float32 ones on average (SmolLM2), which the trainer recomputes in its own dtype."""
    max_batch: int = Field(64, ge=1)
    """Sequences the local engine decodes together."""
    max_prefill_tokens: int = Field(512, ge=1)
    """Prompt tokens the local engine prefills in one step at most (a longer prompt alone);
    the rest of a burst waits a step, so live sequences decode and weight updates land between."""
    engine_process: bool = True
    """Run the local engine in a process of its own (its own GIL: the gateway's Python work does
    not slow its decode steps); false keeps it in the gateway's process."""
    engine_threads: int | None = Field(None, ge=1)
    """Torch threads of the engine process; default: every core this process may use but one."""
    max_model_len: int | None = Field(None, ge=16)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Requests with a larger body get 413."""
    header_timeout: float = Field(15.0, gt=0)
    """Seconds a connection has to complete each request's headers (from its opening, or from
    the previous response); a slower one is closed (`gateway.serving`)."""
    discount: float = Field(1.0, ge=0.0, le=1.0)
    """Default per-turn discount gamma for returns (a run's config may set `discount`)."""
    engine: Literal["local", "vllm", "sglang"] = "local"
    """Which inference engine: the embedded `local` one, or vLLM / SGLang servers."""
    engine_urls: list[str] = []
    """vLLM/SGLang server URLs; more than one puts a router in front of them."""
    engine_launch: bool = False
    """Start and supervise a local vLLM or SGLang server (`engine`) on `model`."""
    vllm_python: str | None = None
    """The interpreter of a venv with vLLM, for `engine_launch` (default: this one)."""
    sglang_python: str | None = None
    """The interpreter of a venv with SGLang, for `engine_launch` (default: this one)."""
    policy_version: int | None = Field(None, ge=0)
    """The policy version of the model's weights, which the tokens sampled before the first
    weight update carry; None: the model directory's `rlgateway_policy.json` version (written by
    `rlgateway export-model`), else 0. A vLLM/SGLang server that an earlier weight update
    labelled with an integer version keeps that label."""

    policy_poll_seconds: float = Field(2.0, ge=0.0)
    """On PostgreSQL, how often this gateway looks for a policy another gateway on the database
    loaded (a trainer publishes to one of them) and loads it too; 0 never looks (one gateway).
    SQLite takes one gateway, which every publish reaches: it never looks."""

    tool_parser: str = "auto"
    """How tool calls are read out of replies: hermes (Qwen2.5's `<tool_call>` JSON), qwen3_coder,
    llama3_json, mistral, glm45, minimax_m2, granite, phi4_mini_json, llama4_pythonic,
    deepseek_v31, kimi_k2 or openai (gpt-oss's harmony, `gateway.core.tool_parsers`); auto: the
    chat template's own format (none recognised: a request that asks for tool calls is a 400
    naming this setting)."""
    reasoning_parser: str = "auto"
    """How reasoning is split off replies: think (`<think>...</think>`), openai_gptoss (gpt-oss's
    harmony analysis channel) or none (`gateway.core.reasoning_parsers`); auto: openai_gptoss for
    a harmony template, think when the chat template writes `<think>`."""

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, name: str) -> str:
        from gateway.core.tool_parsers import TOOL_PARSERS

        if name != "auto" and name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {name!r}: use auto, {', '.join(TOOL_PARSERS)}")
        return name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str) -> str:
        from gateway.core.reasoning_parsers import REASONING_PARSERS

        if name not in ("auto", "none", *REASONING_PARSERS):
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {name!r}: use auto, none, {known}")
        return name

    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
