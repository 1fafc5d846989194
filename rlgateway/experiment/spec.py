"""One spec file per experiment: model, dataset, workflow, reward, the run config (algorithm
preset and overrides), group size, concurrency and evaluation. Checked whole when it is read,
with messages that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.settings import EngineDtype
from rlgateway.experiment.dataset import DatasetSpec
from trainer.config import apply_overrides, describe_error, read_yaml_mapping


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SingleTurnSpec(_Spec):
    type: Literal["single_turn"] = "single_turn"
    prompt: str = "{prompt}"
    """The user message: a template over the row's fields (`{question}`)."""
    system: str | None = None
    """A system message, when set."""


class MultiTurnSpec(_Spec):
    type: Literal["multi_turn"]
    prompt: str = "{prompt}"
    system: str | None = None
    feedback: str = "That is not right. Try again."
    """The environment's reply to a wrong answer (a template over the row and `{turn}`)."""
    max_turns: int = Field(3, ge=1, le=64)
    """Answers at most, per episode."""
    solved: float = 1.0
    """A turn whose reward reaches this ends the episode."""


class AgentSpec(_Spec):
    type: Literal["agent"]
    command: list[str] = Field(min_length=1)
    """The agent program (argv); a first word `python` is this interpreter. Relative paths
    resolve against the spec file's folder."""
    timeout: float = Field(300.0, gt=0)
    """Seconds an episode may take before its process group is killed."""
    prompt: str = "{prompt}"
    """What the grader sees as the prompt."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables."""


class CustomSpec(_Spec):
    type: Literal["custom"]
    target: str
    """`package.module:Name` or `file.py:Name`: a class (built with `args`) or an object with
    `async arun_episode(client, row, episode)`."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class."""


WorkflowSpec = Annotated[
    SingleTurnSpec | MultiTurnSpec | AgentSpec | CustomSpec, Field(discriminator="type")
]


class RewardSpec(_Spec):
    fn: str = "math_answer"
    """A built-in grader (math_answer, exact_match, regex, json_schema), `package.module:fn`
    or `file.py:fn`: `fn(prompt, completion, row) -> float` (sync or async)."""
    timeout: float = Field(15.0, gt=0)
    """Seconds a grading may take; past it the episode is recorded as failed."""
    executor: Literal["thread", "process"] = "thread"
    """thread, or process for CPU-heavy graders (a hung one is killed)."""
    workers: int = Field(4, ge=1)
    """Graders running at once."""


class EvalSpec(_Spec):
    every: int = Field(10, ge=0)
    """Evaluate every this many training steps (and before training and at the end; 0: only
    then)."""
    limit: int | None = Field(None, ge=1)
    """Evaluate on the first N rows of the eval split (default all)."""
    greedy: bool = True
    """Greedy accuracy: one answer per row at temperature 0."""
    samples: int = Field(0, ge=0)
    """Also k answers per row at the run's temperature: mean reward and pass@k."""
    solved: float = 1.0
    """A greedy answer whose reward reaches this counts as correct."""
    concurrency: int = Field(32, ge=1)
    """Eval episodes in flight."""


class EngineSpec(_Spec):
    """The embedded gateway's local engine, as `rlgateway serve`'s flags of the same names set
    it; unset keeps the gateway's default. A deployment given by `--gateway-url` has its own."""

    dtype: EngineDtype | None = None
    """auto: float32 on a CPU, bfloat16 on CUDA; bfloat16 on a CPU decodes 1.2-1.5x faster."""
    max_batch: int | None = Field(None, ge=1)
    """Sequences decoded together."""
    max_prefill_tokens: int | None = Field(None, ge=1)
    """Prompt tokens one engine step prefills at most."""
    threads: int | None = Field(None, ge=1)
    """Torch threads of the engine's process (default: every core but one)."""

    def settings(self) -> dict[str, Any]:
        """The `GatewaySettings` fields this sets (those not left unset)."""
        named = {
            "dtype": self.dtype,
            "max_batch": self.max_batch,
            "max_prefill_tokens": self.max_prefill_tokens,
            "engine_threads": self.threads,
        }
        return {k: v for k, v in named.items() if v is not None}


class ExperimentSpec(_Spec):
    name: str = Field(min_length=1, max_length=100)
    model: str = "tiny"
    """`smollm2` (SmolLM2-135M-Instruct, built offline), `tiny` (the test model), or a Hugging
    Face model directory."""
    served_model_name: str = "policy"
    """The model name agents send."""
    dataset: DatasetSpec
    workflow: WorkflowSpec = Field(default_factory=SingleTurnSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    train: dict[str, Any] = Field(default_factory=dict)
    """The run config as `rlgateway train` reads it (algorithm preset, optim, group_size,
    batch_size, max_steps, temperature, max_tokens, ...)."""
    concurrency: int = Field(4, ge=1)
    """Groups in flight at once (each `train.group_size` episodes); the gateway's staleness
    admission may hold them back further."""
    minutes: float | None = Field(None, gt=0)
    """Stop after this many minutes of rollouts even before `train.max_steps`."""
    eval: EvalSpec = Field(default_factory=EvalSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)


SPEC_KEYS = frozenset(ExperimentSpec.model_fields)


def spec_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` overrides: a key under one of the spec's own sections (`eval.every=5`,
    `dataset.limit=4`, `concurrency=2`) sets the spec; any other key is the run config's, as
    `rlgateway train` takes it (`optim.lr=1e-6` sets `train.optim.lr`)."""
    ours: list[str] = []
    train: list[str] = []
    for item in overrides:
        head = item.partition("=")[0].split(".")[0]
        (ours if head in SPEC_KEYS else train).append(item)
    out = apply_overrides(data, ours)
    if train:
        out["train"] = apply_overrides(dict(out.get("train") or {}), train)
    return out


def load_spec(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    loaded = read_yaml_mapping(path, "experiment spec")
    return parse_spec(spec_overrides(loaded, overrides or []), str(path))


def parse_spec(data: dict[str, Any], source: str = "spec") -> ExperimentSpec:
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{source}: {describe_error(exc, ExperimentSpec)}") from None
