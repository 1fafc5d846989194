"""The part of a run's configuration that the gateway and the trainer must agree on, stored with
the run (`runs.config`, set by `POST /runs` or by the first `rlgateway train` of the run).

The gateway reads it for admission (`eta`, `batch_size`, `max_concurrent`), for the returns it
reports (`discount`), for the sampling contract (`temperature`, `client_sampling`), for the
turn budget (`max_tokens`), for late rewards and for media parts in messages (`media`); the
trainer's `TrainConfig` extends it, so the trainer trains under
the same values. Torch-free and trainer-free: the gateway imports it.

**The sampling contract** (`client_sampling`). The trainer recomputes the logprob of every trained
token as `log_softmax(logits / T)`; that is the distribution the engine sampled from only when no
truncation (top-p, top-k), end-token masking (min_tokens) or greedy decoding changed it.

- `record` (the default): the engine samples with the client's settings, settings the client does
  not send come from the run (`temperature`), and each turn's settings are recorded with it. The
  trainer computes each token's logprob at the temperature that sampled it; a turn it cannot
  reproduce (temperature 0, top_p < 1, top_k > 0, or min_tokens > 0, which masks the end token)
  is recorded and exported but left out of the loss, and counted in the step's
  `untrainable_turns` metric.
- `run`: the gateway samples every turn at the run's `temperature` with no truncation, whatever
  the client sends, and says so in the response header `x-rlgateway-sampling: run` and in the
  turn's record; every turn is trainable.

**Constrained turns** (structured outputs: a turn sampled under a JSON schema, its record's
`json_schema`; a forced tool call held to its tool's schema, its record's `grammar`). The engine
masks every token the schema's grammar forbids before it samples, so the behaviour logprob it
records is the masked distribution's, mu(a|s) = pi(a|s) / Z(s), where Z is the probability the
grammar allowed (vLLM and SGLang report it so too); the trainer's policy pi has no mask. Trained as
it stands, a constrained token's behaviour weight pi_prox / mu would be Z_prox (below 1, shrinking
exactly the tokens the grammar steered) and, without the decoupled loss, its ratio pi_theta / mu
would not be 1 on data just sampled. The policy that acts is the masked one, whose ratio mu_theta /
mu_prox = (pi_theta / pi_prox) (Z_prox / Z_theta) is the unmasked ratio up to the change of Z, and
whose behaviour weight mu_prox / mu_behav is 1 when the token was sampled by the proximal weights.
So the trainer trains a constrained token with the proximal logprob in place of the recorded one
(`constrained_turn`): ratio pi_theta / pi_prox (1 on on-policy data, clipped as every token's),
behaviour weight 1. It computes proximal logprobs for a batch that holds such tokens whatever the
algorithm; leaves them out of the engine-vs-trainer mismatch metrics (they differ by log Z by
design) and reports them apart (`constrained_tokens`, and `constrained_log_mass`, the mean log Z of
the fresh ones: how far the grammar steered). What this gives up: the version-lag correction of a
stale constrained token (bounded by `eta`), and the gradient of log Z (the term -grad log Z_theta(s)
of grad log mu_theta, which the mask would need in the trainer to compute).

**The turn budget** (`max_tokens`). The trainer shapes and normalises by the run's max new tokens
per turn (DAPO's overlong penalty ends there, Dr.GRPO's norm_len is it), so the gateway enforces
it: a turn of a run that sets it samples at most `max_tokens` new tokens, whatever the client asks
(`max_tokens`, `max_completion_tokens`, `max_output_tokens`; the cap when it asks none), and says
so in the response header `x-rlgateway-max-tokens: capped N` and in the turn's record
(`max_tokens_cap`). A run that sets none is not capped.

**Side requests** (`side_requests`). Agent CLIs send requests of their own through the agent's
session that are not the agent's work: Claude Code asks for a conversation title and checks its
quota with a one-token request; a harness may ask for a summary. Their replies are not what the
episode's reward judges, so training them on it teaches the model nothing true. A run lists rules
(`SideRule`: a pattern of the system prompt, a bound on the `max_tokens` the client asked, a
header); a request that one of them matches is a side request: answered and recorded as any
other, its turn marked with the rule's name (`completions.side`), but never trained: the trainer
and the export leave its turn out as they leave an aborted one (its tokens are context for a later
turn of its segment at most, `store.trajectories`), the page shows it apart, and the answer says
so in the response header `x-rlgateway-side: RULE`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ClientSampling = Literal["record", "run"]

SAMPLING_HEADER = "x-rlgateway-sampling"
"""Response header naming the contract a turn was sampled under (`record` or `run`)."""

SIDE_HEADER = "x-rlgateway-side"
"""Response header of a side request: the name of the rule that matched it (module docstring)."""

MAX_TOKENS_HEADER = "x-rlgateway-max-tokens"
"""Response header of a turn of a run that sets `max_tokens` N: `capped N`, its new tokens were
at most N (module docstring, the turn budget)."""


class SideRule(BaseModel):
    """Marks matching requests as side requests (module docstring): a request matches when every
    condition the rule sets holds (at least one must be set)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    """What the turn's record, the page and the `x-rlgateway-side` header call it."""
    system: str | None = Field(None, min_length=1)
    """A regular expression (Python's `re`) searched for in the request's system prompt: its
    system and developer messages (chat, Responses `instructions`, Messages `system`), joined
    by newlines. A request without one never matches."""
    max_tokens_below: int | None = Field(None, ge=1)
    """The client asked for fewer new tokens than this (`max_tokens`, `max_completion_tokens`,
    `max_output_tokens`); a request that asks none never matches."""
    header: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    """The request carries this header (its name, any case), whatever its value."""

    @field_validator("system")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="after")
    def _sets_a_condition(self) -> Self:
        if self.system is None and self.max_tokens_below is None and self.header is None:
            raise ValueError(
                f"side request rule {self.name!r} sets no condition: give system, "
                "max_tokens_below or header"
            )
        return self

    def matches(self, system: str, max_tokens: int | None, headers: Mapping[str, str]) -> bool:
        """Whether a request with this system prompt, asked maximum of new tokens and header
        names (lower case) is one this rule marks."""
        if self.system is not None and (not system or re.search(self.system, system) is None):
            return False
        if self.max_tokens_below is not None and (
            max_tokens is None or max_tokens >= self.max_tokens_below
        ):
            return False
        return self.header is None or self.header.lower() in headers


class RunConfig(BaseModel):
    """The run-owned settings (see the module docstring). Every field has a default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    batch_size: int = Field(8, ge=1)
    """Trajectories (ended, rewarded sessions) per training step: AReaL's B."""
    eta: int = Field(1, ge=0)
    """Staleness bound: no token older than `eta` policy versions is trained; 0 is synchronous."""
    max_concurrent: int | None = Field(None, ge=1)
    """At most this many active sessions (the gateway answers 429 beyond it); None: no limit."""
    discount: float = Field(1.0, ge=0, le=1)
    """Per-turn discount gamma of the returns."""
    temperature: float = Field(1.0, gt=0)
    """The run's sampling temperature: what a request that sends none samples at (and, with
    `client_sampling: run`, every request)."""
    client_sampling: ClientSampling = "record"
    """How client sampling settings are treated: `record` or `run` (module docstring)."""
    max_tokens: int | None = Field(None, ge=1)
    """The run's max new tokens per turn: the gateway caps every turn at it (module docstring, the
    turn budget), and the trainer's DAPO overlong shaping and Dr.GRPO's norm_len use it. None: no
    cap (a turn generates what the client asks, up to the model's context)."""
    late_rewards: Literal["refuse", "record"] = "refuse"
    """A reward for a session the trainer already settled (trained, dropped): `refuse` answers
    409; `record` keeps it for export only, flagged, and it is never trained."""
    media: Literal["refuse", "placeholder"] = "refuse"
    """An image, document, file or audio part in a request's messages (the model reads text):
    `refuse` answers 400 naming the part; `placeholder` renders it as `[image omitted]` (and the
    like), recorded as context, so that an agent that read a picture goes on
    (`gateway.core.media`)."""
    side_requests: list[SideRule] = Field(default_factory=list)
    """Rules that mark an agent's side requests (a title, a quota check): recorded, answered,
    never trained (module docstring). The first rule that matches names the request's mark."""

    @field_validator("side_requests")
    @classmethod
    def _distinct_names(cls, rules: list[SideRule]) -> list[SideRule]:
        names = [r.name for r in rules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"side request rules share a name: {', '.join(twice)}")
        return rules

    def side_rule(
        self, system: str, max_tokens: int | None, headers: Mapping[str, str]
    ) -> str | None:
        """The name of the first side request rule the request matches (`SideRule.matches`),
        or None: the request is the agent's own work."""
        for rule in self.side_requests:
            if rule.matches(system, max_tokens, headers):
                return rule.name
        return None


RUN_FIELDS: tuple[str, ...] = tuple(RunConfig.model_fields)
"""The keys of a stored run config that the gateway reads."""


def run_config_of(stored: dict[str, Any]) -> RunConfig:
    """The run-owned part of a run's stored config (a whole training config, or a part of it),
    defaults for what it does not set. A stored config is validated when it is stored, so a bad
    value here is a bug; it raises pydantic's ValidationError."""
    return RunConfig.model_validate({k: stored[k] for k in RUN_FIELDS if k in stored})


def throttled(stored: dict[str, Any]) -> bool:
    """Whether the gateway enforces the staleness bound for this run: its config sets `eta` or
    `batch_size` (a run made for browsing or export alone sets neither and is never throttled)."""
    return "eta" in stored or "batch_size" in stored


def constrained_turn(sampling: Mapping[str, Any]) -> bool:
    """Whether a turn was sampled under a grammar (its recorded `json_schema`, or `grammar`: a
    forced tool call): trained with the proximal logprob as its behaviour logprob (module
    docstring, "Constrained turns")."""
    return sampling.get("json_schema") is not None or sampling.get("grammar") is not None


def reproducible_temperature(sampling: Mapping[str, Any], default: float) -> float | None:
    """The temperature a turn's tokens were drawn at (its recorded sampling settings; `default`,
    the run's, for what it does not record), or None when the trainer cannot reproduce that
    distribution: greedy, or truncated by top-p, top-k, min-p, or min_tokens (which masks EOS).
    The one rule of the contract: the trainer trains by it, and what the gateway samples under
    `run` passes it."""
    temperature = sampling.get("temperature")
    t = default if temperature is None else float(temperature)
    top_p = sampling.get("top_p")
    top_k = sampling.get("top_k")
    min_p = sampling.get("min_p")
    min_new = sampling.get("min_new_tokens")
    if t <= 0 or (top_p is not None and float(top_p) < 1.0):
        return None
    if (top_k is not None and int(top_k) > 0) or (min_p is not None and float(min_p) > 0):
        return None
    if min_new is not None and int(min_new) > 0:
        return None
    return t
