"""The protocol-neutral turn: what every generation route shares.

One turn is neutral prompts (chat messages with tools, or token ids) and sampling settings in; it
renders each prompt (or continues the session's segment it extends, `gateway.segments`), plans
where each choice is recorded, generates n choices per prompt, parses tool calls, commits, and
hands out neutral `Choice`s (or, streaming, `Delta`s as tokens arrive). The protocol modules
(`gateway.chat`, `gateway.completions`, `gateway.responses`, `gateway.messages`) are adapters on
it: a request to a `TurnSpec`, and a turn's choices or deltas to their response JSON and events.
Because all of them record the same neutral transcript, one session can switch protocol and keep
its token-exact continuation wherever the histories agree.

The response is sent only after its completions are committed; a stream's final events likewise
wait for the commit. A turn whose client goes away (a stream, or a request cancelled because its
client disconnected) is committed with what was generated, marked aborted; so is a stream whose
engine fails after its first token (the adapter then ends it with its protocol's error event). A
stream answers only once its first piece was generated: a failure before it is an HTTP error.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import anyio

from engines.base import Engine, GenerateRequest, SamplingParams, TokenChunk
from engines.errors import PromptTooLongError
from gateway.chat_render import ChatRenderer, Message
from gateway.choices import ChoiceRun, RunGroup, TokenPieces
from gateway.detok import IncrementalDecoder
from gateway.reasoning_parsers import ReasoningParser, Split
from gateway.recorder import ChoiceOutcome, Match, Plan, Recorder
from gateway.sampling import Asked, contract_of, record_of, sampling_params
from gateway.segments import (
    LiveSegment,
    chat_transcript,
    extends,
    extends_tokens,
    repeats,
    repeats_tokens,
)
from store.run_config import ClientSampling, RunConfig
from store.types import JSON, LastTurn, TurnStatus

if TYPE_CHECKING:
    from gateway.tool_parsers import ToolCallParser

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
    """Normalized (`gateway.chat_render.normalize_messages`): what is rendered and compared."""
    tools: list[dict[str, Any]]
    """OpenAI function tools (`{"type": "function", "function": {...}}`)."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    continues: str = ""
    """The start of the reply, written by the client (an Anthropic prefill): part of the prompt
    and of the reply's text, never sent back to the client."""


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
    """Its reasoning (`gateway.reasoning_parsers`), split off `text`; None: none."""
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


WHOLE_OUTPUT_INTERVAL = 16
"""`GenerateRequest.stream_interval` of a non-streaming request: its response waits for the whole
output, so the engine hands tokens over 16 at a time instead of one message per token (as the
vLLM adapter's `stream_interval`). A stop string is still seen in the chunk that completes it."""


def choice_requests(
    sp: SamplingParams,
    prompt: list[int],
    n: int,
    session_id: str | None = None,
    *,
    stream: bool = True,
) -> list[GenerateRequest]:
    """n engine requests; with a seed, choice i uses seed + i so choices differ but reproduce.
    A session's request ids start with "{session_id}/", which a router uses for affinity.
    `stream=False`: the caller wants whole outputs (see `WHOLE_OUTPUT_INTERVAL`)."""
    out = []
    interval = 1 if stream else WHOLE_OUTPUT_INTERVAL
    for i in range(n):
        seed = None if sp.seed is None else sp.seed + i
        req = GenerateRequest(
            prompt_ids=tuple(prompt), sampling=replace(sp, seed=seed), stream_interval=interval
        )
        if session_id is not None:
            req = replace(req, request_id=f"{session_id}/{req.request_id}")
        out.append(req)
    return out


def recorded_prefill(request: JSON) -> str:
    """The prefill of a recorded request. A record older than `RECORD_KEY` is a chat body alone,
    whose `tool_choice` says it."""
    own = request.get(RECORD_KEY)
    if isinstance(own, dict):
        return str(own.get("prefill", ""))
    choice = request.get("tool_choice")
    if isinstance(choice, dict):
        return f'<tool_call>\n{{"name": {json.dumps(choice["function"]["name"])}, "arguments": '
    return "<tool_call>\n" if choice == "required" else ""


@dataclass(eq=False, slots=True)
class _Group:
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


class TurnCore:
    """Starts turns on one engine, renderer and recorder (None: nothing is recorded)."""

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        recorder: Recorder | None,
        model_name: str,
        parsers: Parsers,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.recorder = recorder
        self.model_name = model_name
        self.parsers = parsers
        self.pieces = TokenPieces(renderer.tokenizer)
        markers = {*parsers.tools.markers, *parsers.reasoning_markers}
        added = getattr(renderer.tokenizer, "added_tokens_decoder", {})
        self._keep = frozenset(i for i, t in added.items() if t.special and t.content in markers)
        """Special tokens that are parsers' markers: decoded as text, so a parser sees them."""

    def prefill(self, prompt: ChatPrompt) -> str:
        """The text forced at the start of the reply: the client's own start, then what a
        required or named tool call forces."""
        choice, forced = prompt.tool_choice, ""
        if choice.mode == "required":
            forced = self.parsers.tools.prefill(None)
        elif choice.mode == "named":
            forced = self.parsers.tools.prefill(choice.name)
        return prompt.continues + forced

    async def start(
        self,
        spec: TurnSpec,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        respond: Callable[[Turn, Choice], JSON],
    ) -> Turn:
        """Plan every prompt and start its choices; for a stream, return once the first piece
        was generated. `run`: the config of the session's run, which the request samples under
        (`gateway.sampling`; None outside a session). `retry`: the client says this repeats a
        request whose reply it never got (`gateway.segments`). `respond`: a choice's response
        JSON in the adapter's protocol, which is recorded with it."""
        sp = sampling_params(spec.asked, run)
        groups: list[_Group] = []
        try:
            for prompt in spec.prompts:
                prefill = self.prefill(prompt) if isinstance(prompt, ChatPrompt) else ""
                ids, plan = await self._prompt(prompt, prefill, session_id, spec.n, retry)
                group = _Group(prompt, prefill, ids, plan, [], self._opens(prompt, ids))
                groups.append(group)
                holdback = [*self.parsers.reasoning_markers]
                stops, kept = spec.stop, frozenset[str]()
                if group.parses_tools:
                    holdback += self.parsers.tools.markers
                    end = self.parsers.tools.call_end
                    single = isinstance(prompt, ChatPrompt) and not prompt.tool_choice.parallel
                    if end is not None and single:
                        stops, kept = [*spec.stop, end], frozenset({end})
                for req in choice_requests(sp, ids, spec.n, session_id, stream=spec.stream):
                    group.runs.append(
                        ChoiceRun(
                            index=(len(groups) - 1) * spec.n + len(group.runs),
                            request=req,
                            stream=self._generate(req, spec.cap_to_context),
                            decoder=IncrementalDecoder(
                                self.renderer.tokenizer,
                                stops,
                                holdback=holdback,
                                keep=self._keep,
                                kept_stops=kept,
                            ),
                        )
                    )
        except BaseException:
            self._release(groups)
            raise
        turn = Turn(self, spec, groups, sp, contract_of(run), respond)
        if spec.stream:
            await turn.start_stream()
        return turn

    def _generate(self, req: GenerateRequest, cap: bool) -> AsyncIterator[TokenChunk]:
        """The engine's stream (`generate` validates: it raises before any token)."""
        try:
            return self.engine.generate(req)
        except PromptTooLongError as exc:
            room = exc.max_model_len - exc.prompt_len
            if not cap or room < 1:
                raise
            return self.engine.generate(
                replace(req, sampling=replace(req.sampling, max_new_tokens=room))
            )

    def _release(self, groups: list[_Group]) -> None:
        for g in groups:
            if g.plan is not None and self.recorder is not None:
                self.recorder.release(g.plan)

    # -- planning ----------------------------------------------------------------------------

    def _opens(self, prompt: Prompt, ids: list[int]) -> bool:
        reasoning = self.parsers.reasoning
        if reasoning is None or not isinstance(prompt, ChatPrompt):
            return False
        tail = self.renderer.decode(ids[-16:], skip_special_tokens=False)
        return reasoning.opens(tail)

    async def _prompt(
        self, prompt: Prompt, prefill: str, session_id: str | None, n: int, retry: bool
    ) -> tuple[list[int], Plan | None]:
        if isinstance(prompt, TokenPrompt):
            ids = prompt.ids

            def given() -> list[int]:
                return ids

            fresh: Callable[[], list[int]] = given
            choose = functools.partial(_choose_tokens, ids, given, retry)
        else:
            r = self.renderer
            fresh = functools.partial(r.prompt, prompt.messages, prompt.tools, prefill)
            choose = functools.partial(_choose_chat, r, prompt, prefill, retry)
        if session_id is None or self.recorder is None:
            return await asyncio.to_thread(fresh), None
        plan = await self.recorder.plan(session_id, n, choose, fresh)
        return plan.prompt_ids, plan


def _choose_tokens(
    ids: list[int], given: Callable[[], list[int]], retry: bool, segments: list[LiveSegment]
) -> Match | None:
    for seg in reversed(segments):
        if extends_tokens(seg, ids):
            return Match(seg, given)
        last = seg.replaceable(retry=retry)
        if last is not None and repeats_tokens(seg, last, ids):
            return Match(seg, given, last)
    return None


def _choose_chat(
    r: ChatRenderer, prompt: ChatPrompt, prefill: str, retry: bool, segments: list[LiveSegment]
) -> Match | None:
    for seg in reversed(segments):
        transcript = seg.transcript
        assert transcript is not None
        if extends(transcript, prompt.messages, prompt.tools):
            render = functools.partial(
                r.continuation,
                seg.tokens,
                transcript["messages"],
                prompt.messages,
                prompt.tools,
                prefill,
            )
            return Match(seg, render)
        last = seg.replaceable(retry=retry)
        if last is not None and _repeats(seg, last, prompt, prefill):
            return Match(seg, functools.partial(list, seg.tokens[: last.prompt_len]), last)
    return None


def _repeats(seg: LiveSegment, last: LastTurn, prompt: ChatPrompt, prefill: str) -> bool:
    """The request is the one `last` answered, so its prompt is `last`'s."""
    return repeats(seg.transcript, prompt.messages, prompt.tools) and (
        recorded_prefill(last.request) == prefill
    )


class Turn:
    """One request in flight: its choices' runs, their commit, and their neutral results."""

    def __init__(
        self,
        core: TurnCore,
        spec: TurnSpec,
        groups: list[_Group],
        sampling: SamplingParams,
        contract: ClientSampling,
        respond: Callable[[Turn, Choice], JSON],
    ) -> None:
        self.core = core
        self.spec = spec
        self.groups = groups
        self.sampling = sampling
        self.contract = contract
        self.respond = respond
        self.id = f"{spec.id_prefix}{uuid.uuid4().hex[:29]}"
        self.created = int(time.time())
        self.runs = [r for g in groups for r in g.runs]
        self.group = RunGroup(self.runs)
        self.committed = False
        self.shown = [len(_continues(self._group_of(r))) for r in self.runs]
        """How much of each choice's visible text was streamed."""
        self.thought = [0] * len(self.runs)
        """How much of each choice's reasoning was streamed."""
        self._choices: list[Choice] | None = None
        self._call_ids: dict[int, list[str]] = {}

    # -- results -----------------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return sum(len(g.ids) for g in self.groups)

    @property
    def completion_tokens(self) -> int:
        return sum(len(r.ids) for r in self.runs)

    def completion_id(self, i: int) -> str:
        return self.id if len(self.runs) == 1 else f"{self.id}-{i}"

    def _group_of(self, run: ChoiceRun) -> _Group:
        return self.groups[run.index // self.spec.n]

    def full_text(self, run: ChoiceRun) -> str:
        return self._group_of(run).prefill + run.decoder.text

    def _split(self, group: _Group, text: str) -> Split:
        reasoning = self.core.parsers.reasoning
        if reasoning is None or not isinstance(group.prompt, ChatPrompt):
            return Split(None, text, True)
        return reasoning.split(text, opened=group.opened)

    def _visible(self, run: ChoiceRun) -> Split:
        """What may be shown now: the reasoning so far, and the answer's text once the reasoning
        has ended, never tool-call markup (nor the whitespace before it), never what may still
        become a stop string or a marker."""
        group = self._group_of(run)
        split = self._split(group, group.prefill + run.decoder.safe_text())
        text = split.answer if split.done else ""
        if group.parses_tools:
            cut = [at for m in self.core.parsers.tools.markers if (at := text.find(m)) >= 0]
            text = (text[: min(cut)] if cut else text).rstrip()
        return Split(split.reasoning, text, split.done)

    def _choice(self, run: ChoiceRun) -> Choice:
        group = self._group_of(run)
        text = self.full_text(run)
        split = self._split(group, text)
        finish = run.finish_reason or "abort"
        content: str | None = split.answer if split.reasoning is None else split.answer or None
        calls: tuple[ToolCall, ...] = ()
        if group.parses_tools:
            content, parsed = self.core.parsers.tools.parse(split.answer)
            ids = self._call_ids.setdefault(run.index, [])
            while len(ids) < len(parsed):
                ids.append(f"call_{uuid.uuid4().hex[:24]}")
            calls = tuple(
                ToolCall(i, c.name, c.arguments) for i, c in zip(ids, parsed, strict=False)
            )
            if calls and finish == "stop":
                finish = "tool_calls"
        return Choice(
            index=run.index,
            completion_id=self.completion_id(run.index),
            run=run,
            text=text,
            reasoning=split.reasoning,
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            # the client's own stop strings; a call's end (one call only) is none of them
            stop_string=run.decoder.matched if run.decoder.matched in self.spec.stop else None,
            continued=_continues(group),
        )

    @property
    def choices(self) -> list[Choice]:
        """Every choice as it stands (final once the turn has ended)."""
        if self._choices is not None:
            return self._choices
        return [self._choice(r) for r in self.runs]

    def _finish(self, aborted: bool) -> list[Choice]:
        if self._choices is None:
            if aborted:
                for r in self.runs:
                    r.mark_aborted()
            self._choices = [self._choice(r) for r in self.runs]
        return self._choices

    # -- recording ---------------------------------------------------------------------------

    def _transcript(self, prompt: Prompt, choice: Choice) -> JSON:
        if isinstance(prompt, TokenPrompt):
            return dict(COMPLETION_TRANSCRIPT)
        reply: dict[str, Any] = {"role": "assistant", "content": choice.content or ""}
        if choice.reasoning:
            reply["reasoning_content"] = choice.reasoning
        if choice.tool_calls:
            reply["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.name, "arguments": parse_arguments(c.arguments)},
                }
                for c in choice.tool_calls
            ]
        return chat_transcript([*prompt.messages, reply], prompt.tools)

    async def _commit(self, aborted: bool) -> None:
        recorder = self.core.recorder
        if recorder is None or self.committed:
            return
        self.committed = True
        choices = self._finish(aborted)
        sampling = record_of(self.sampling, self.contract) | self.spec.sampling_extra
        for g in self.groups:
            if g.plan is None:
                continue
            if aborted and not any(r.ids for r in g.runs):
                recorder.release(g.plan)
                continue
            request = self.spec.request | {
                RECORD_KEY: {"protocol": self.spec.protocol, "prefill": g.prefill}
            }
            outcomes = []
            for r in g.runs:
                choice = choices[r.index]
                outcomes.append(
                    ChoiceOutcome(
                        completion_id=choice.completion_id,
                        transcript=self._transcript(g.prompt, choice),
                        output_ids=list(r.ids),
                        logprobs=list(r.logprobs),
                        versions=list(r.versions),
                        finish_reason=choice.finish_reason,
                        status=TurnStatus.ABORTED if aborted else TurnStatus.OK,
                        response=self.respond(self, choice),
                        latency_ms=r.latency_ms,
                        ttft_ms=r.ttft_ms,
                    )
                )
            await recorder.commit(g.plan, outcomes, sampling, request)

    def _release(self) -> None:
        if not self.committed:
            self.committed = True
            self.core._release(self.groups)

    # -- whole ---------------------------------------------------------------------------------

    async def complete(self) -> list[Choice]:
        """Run every choice to its end, commit, and return the choices."""
        try:
            await self.group.wait()
        except BaseException as exc:
            self.group.cancel()
            # Cancelled (its client went away): record what was generated, aborted. Failed: the
            # client gets the error, and nothing is recorded.
            with anyio.CancelScope(shield=True):
                await self.group.settle()
                if isinstance(exc, Exception):
                    self._release()
                else:
                    await self._commit(aborted=True)
            raise
        await self._commit(aborted=False)
        return self._finish(aborted=False)

    # -- streaming ---------------------------------------------------------------------------

    async def start_stream(self) -> None:
        """Start generating and return once a choice has produced its first piece, so that a
        failure before it reaches the client as an HTTP error rather than a broken stream."""
        try:
            await self.group.start()
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's progress as it happens; when every choice has ended, the turn is
        committed and the iteration ends (`choices` then holds the final ones). A failure (of
        the engine or the commit) is raised: the adapter then calls `close` and ends its stream
        with an error event."""
        sent_tokens = [0] * len(self.runs)
        async for run in self.group.progress():
            i = run.index
            shown = self._visible(run)
            new = _more(shown.answer, self.shown, i)
            thought = _more(shown.reasoning or "", self.thought, i)
            lo, hi = sent_tokens[i], len(run.ids)
            sent_tokens[i] = hi
            if new or thought or hi > lo:
                yield Delta(run, new, thought, lo, hi)
        await self._commit(aborted=False)
        self._finish(aborted=False)

    def unsent(self, choice: Choice) -> str:
        """The part of a finished choice's content not yet streamed."""
        return (choice.content or "")[self.shown[choice.index] :]

    def unsent_reasoning(self, choice: Choice) -> str:
        """The part of a finished choice's reasoning not yet streamed."""
        return (choice.reasoning or "")[self.thought[choice.index] :]

    async def close(self) -> None:
        """Stop generating; record the turn, aborted, unless it was committed (idempotent)."""
        self.group.cancel()
        # The server cancels a response whose client left through an anyio cancel scope, which
        # would cancel these awaits too: shield them, the turn must be recorded.
        with anyio.CancelScope(shield=True):
            await self.group.settle()
            if not self.committed:
                await self._commit(aborted=True)


def _continues(group: _Group) -> str:
    return group.prompt.continues if isinstance(group.prompt, ChatPrompt) else ""


def _more(text: str, sent: list[int], i: int) -> str:
    """What `text` adds to the `sent[i]` characters already sent (and count it sent)."""
    if len(text) <= sent[i]:
        return ""
    new, sent[i] = text[sent[i] :], len(text)
    return new


@dataclass(frozen=True, slots=True)
class Parsers:
    """How replies are read: tool calls by the model family's parser, reasoning by its parser
    (None: the model does not reason)."""

    tools: ToolCallParser
    reasoning: ReasoningParser | None = None

    @property
    def reasoning_markers(self) -> tuple[str, ...]:
        return () if self.reasoning is None else self.reasoning.markers


def parse_arguments(arguments: str) -> Any:
    """A call's arguments as the transcript keeps them: parsed (an agent may echo them back with
    other spacing), or the string when it is not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
