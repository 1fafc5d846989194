"""The neutral turn: what a protocol's adapter gives the turn core (`gateway.core.turn`) and gets
back.

An adapter turns its request into a `TurnSpec` (neutral prompts: `ChatPrompt` or `TokenPrompt`,
the sampling asked for, n, stop strings, the body to record) and the turn's `Choice`s (or, while
it streams, `Delta`s) into its response JSON and events. `Parsers` say how replies are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.core.chat_render import Message
from gateway.core.choices import ChoiceRun, TokenPieces
from gateway.core.reasoning_parsers import ReasoningParser
from gateway.core.recorder import Plan, Recorder
from gateway.core.sampling import Asked
from store.types import JSON

if TYPE_CHECKING:
    from gateway.core.tool_parsers import ToolCallParser

COMPLETION_TRANSCRIPT = {"kind": "completion"}
RECORD_KEY = "rlgateway"
"""The key of the gateway's own part of a recorded request: `{"protocol", "prefill"}`."""


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the reply may do with the tools: none (tool calls stay text), auto, required (some
    tool), named (the tool `name`). A required or named call is forced by a prefill: text the
    tool-call parser writes at the start of the reply, part of the prompt and of the reply."""

    mode: ToolMode = "none"
    name: str = ""
    parallel: bool = True
    """False: one call at most (`parallel_tool_calls: false`, Anthropic's
    `disable_parallel_tool_use`): the reply stops at the end of its first call, where the
    format marks it (`ToolCallParser.call_end`)."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to render with the model's chat template."""

    messages: list[Message]
    """Normalized (`gateway.core.chat_render.normalize_messages`): what is rendered and compared."""
    tools: list[dict[str, Any]]
    """OpenAI function tools (`{"type": "function", "function": {...}}`)."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    continues: str = ""
    """The start of the reply, written by the client (an Anthropic prefill): part of the prompt
    and of the reply's text, never sent back to the client."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the chat template (chat's `chat_template_kwargs`: `enable_thinking`, ...);
    a segment continues only under the same ones."""


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt given as token ids: a segment it starts with is extended as it is."""

    ids: list[int]


Prompt = ChatPrompt | TokenPrompt


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One request, in neutral terms. Every prompt gets `n` choices."""

    protocol: str
    """chat, completions, responses or messages: recorded with the turn."""
    id_prefix: str
    """The turn's id is this prefix and 29 hex digits (`chatcmpl-`, `resp_`, ...)."""
    prompts: list[Prompt]
    asked: Asked
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    request: JSON = field(default_factory=dict)
    """The request body as the protocol received it (recorded)."""
    sampling_extra: JSON = field(default_factory=dict)
    """Protocol settings recorded with the sampling (chat's stop and n)."""
    cap_to_context: bool = False
    """The asked maximum of new tokens is a limit, not a demand: where the prompt leaves less
    room in the model's context, generate up to the room left (Anthropic's `max_tokens`, the
    Responses API's `max_output_tokens`), not a 400 as chat completions answers."""
    edge_is_error: bool = False
    """A reply cut by the end of the model's context (`Choice.context_edge`) is answered as an
    error the client understands (the Responses API's `context_length_exceeded`, on which Codex
    compacts its history): the client never takes it as a reply, so it is recorded aborted and
    never trained."""


@dataclass(slots=True)
class Exchange:
    """What a request carries beside its body, and what its answer says beside its JSON: the
    HTTP edge as the turn core sees it."""

    headers: Mapping[str, str] = field(default_factory=dict)
    """The request's headers (names in lower case, or a case-insensitive mapping)."""
    answer_headers: dict[str, str] = field(default_factory=dict)
    """Headers the turn adds to its answer (a side request's `x-rlgateway-side`), set before
    the answer starts."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    """Stable for the turn: `call_...`; an adapter may reformat it (Anthropic's `toolu_...`)."""
    name: str
    arguments: str
    """A JSON string, as the model wrote it (OpenAI's `arguments`)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished (or aborted) choice, in neutral terms."""

    index: int
    completion_id: str
    run: ChoiceRun
    """Its exact tokens, logprobs and top logprobs."""
    text: str
    """Everything it generated, prefill included, cut at a matched stop string."""
    reasoning: str | None
    """Its reasoning (`gateway.core.reasoning_parsers`), split off `text`; None: none."""
    content: str | None
    """The text outside tool calls (None: there was none)."""
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    """stop, length, tool_calls (stopped with tool calls) or abort."""
    stop_string: str | None
    """The stop string that ended it, if one did."""
    continued: str = ""
    """The client's own start of the reply (`ChatPrompt.continues`), which `content` begins
    with when the reply is text: a protocol sends back only what follows it."""
    context_edge: bool = False
    """It ended at `length` because the model's context ran out, not at a maximum the client or
    the run set (`ChoiceRun.context_bound`)."""


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A forced call's progress while it streams (`gateway.core.call_stream`): its id and name
    when it opens, then more of its arguments' JSON text."""

    id: str
    name: str
    arguments: str
    """The arguments' text this delta adds."""
    opens: bool
    """The call's first delta: the client learns its id and name here."""


@dataclass(frozen=True, slots=True)
class Delta:
    """What a streaming choice adds: new visible text (never tool-call markup, never what may
    still become a stop string) and new tokens, `run.ids[lo:hi]`."""

    run: ChoiceRun
    text: str
    reasoning: str
    """New reasoning text (streamed before the answer's text)."""
    lo: int
    hi: int
    call: CallDelta | None = None
    """A forced call's arguments as they are sampled (each protocol's stream sends them)."""


@dataclass(eq=False, slots=True)
class Group:
    """One prompt of the turn and its n choices."""

    prompt: Prompt
    prefill: str
    ids: list[int]
    plan: Plan | None
    runs: list[ChoiceRun]
    opened: bool = False
    """The prompt opens a reasoning block (`ReasoningParser.opens`)."""

    @property
    def parses_tools(self) -> bool:
        return isinstance(self.prompt, ChatPrompt) and self.prompt.tool_choice.mode != "none"


@dataclass(frozen=True, slots=True)
class Parsers:
    """How replies are read: tool calls by the model family's parser, reasoning by its parser
    (None: the model does not reason)."""

    tools: ToolCallParser
    reasoning: ReasoningParser | None = None

    @property
    def reasoning_markers(self) -> tuple[str, ...]:
        return () if self.reasoning is None else self.reasoning.markers

    @property
    def reasoning_name(self) -> str:
        return "none" if self.reasoning is None else self.reasoning.name

    def shown(self) -> dict[str, str]:
        """What `/health` and `/v1/models` say reads the replies: the tool-call parser
        (`unknown`: the template's format is not one the gateway knows) and the reasoning one."""
        return {"tool_calls": self.tools.name, "reasoning": self.reasoning_name}


@dataclass(frozen=True, slots=True)
class TurnContext:
    """What a turn in flight (`gateway.core.turn_run.Turn`) and its adapter read of the core that
    started it (`gateway.core.turn.TurnCore`): a turn holds this, never the core, so that neither
    module imports the other."""

    recorder: Recorder | None
    """None: nothing is recorded."""
    parsers: Parsers
    pieces: TokenPieces
    """Token ids to their text and bytes (logprob entries)."""
    model_name: str
    """The `model` every response names."""

    def release(self, groups: list[Group]) -> None:
        """Give back the segments a turn reserved and did not commit."""
        for g in groups:
            if g.plan is not None and self.recorder is not None:
                self.recorder.release(g.plan)


def parse_arguments(arguments: str) -> Any:
    """A call's arguments as the transcript keeps them: parsed (an agent may echo them back with
    other spacing), or the string when it is not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
