"""The protocol-neutral turn: what every generation route shares.

One turn is neutral prompts (chat messages with tools, or token ids) and sampling settings in; it
renders each prompt (or continues the session's segment it extends, `gateway.core.segments`),
plans where each choice is recorded, generates n choices per prompt, parses tool calls, commits,
and hands out neutral `Choice`s (or, streaming, `Delta`s as tokens arrive). The protocol
packages (`gateway.protocols.openai` chat and completions, `gateway.protocols.responses`,
`gateway.protocols.anthropic`) hold adapters on it: a request to a `TurnSpec`, and a turn's choices
or deltas to their response JSON and events. Because all of them record the same neutral transcript,
one session can switch protocol and keep its token-exact continuation wherever the histories agree.
This module starts a turn (plans its prompts, starts its choices); `gateway.core.turn_run.Turn` is
the turn in flight (parsing, commit, results); `gateway.core.turn_types` holds the neutral structs.

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
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from engines.base import Engine, GenerateRequest, SamplingParams, TokenChunk
from engines.errors import PromptTooLongError
from engines.grammar import GrammarError, lark_grammar
from gateway.core.chat_render import ChatRenderer
from gateway.core.choices import ChoiceRun, TokenPieces
from gateway.core.detok import IncrementalDecoder
from gateway.core.recorder import Match, Plan, Recorder
from gateway.core.sampling import contract_of, max_tokens_cap, sampling_params
from gateway.core.segments import LiveSegment, extends, extends_tokens, repeats, repeats_tokens
from gateway.core.tool_parsers import TOOL_PARSERS, NoToolParser
from gateway.core.turn_run import Turn
from gateway.core.turn_types import (
    RECORD_KEY,
    ChatPrompt,
    Choice,
    Exchange,
    Group,
    Parsers,
    Prompt,
    TokenPrompt,
    TurnContext,
    TurnSpec,
)
from gateway.errors import BadRequest
from store.run_config import SIDE_HEADER, RunConfig
from store.types import JSON, LastTurn

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
        self.context = TurnContext(recorder, parsers, self.pieces, model_name)
        """What the turns this core starts read of it."""
        markers = {*parsers.tools.markup, *parsers.reasoning_markers}
        added = getattr(renderer.tokenizer, "added_tokens_decoder", {})
        self._keep = frozenset(i for i, t in added.items() if t.special and t.content in markers)
        """Special tokens that are parsers' markers: decoded as text, so a parser sees them."""
        self._marks = {t.content: i for i, t in added.items()}
        """The added tokens, as a forced call's grammar writes its markup (`tool_grammars`)."""
        self._grammar = functools.lru_cache(maxsize=256)(self._held_grammar)
        """`_held_grammar`, cached (a tool schema that fails raises each time, never cached)."""

    def prefill(self, prompt: ChatPrompt) -> str:
        """The text forced at the start of the reply: the client's own start, then what a
        required or named tool call forces."""
        choice, forced = prompt.tool_choice, ""
        if choice.mode == "required":
            forced = self.parsers.tools.prefill(None)
        elif choice.mode == "named":
            forced = self.parsers.tools.prefill(choice.name)
        return prompt.continues + forced

    def check_tools(self, prompts: list[Prompt]) -> None:
        """A 400 for a request whose tool calls would be read when no parser knows the model's
        format (`NoToolParser`): never read by a guess, which would hand the agent its calls as
        plain text."""
        if not isinstance(self.parsers.tools, NoToolParser):
            return
        for prompt in prompts:
            if isinstance(prompt, ChatPrompt) and prompt.tool_choice.mode != "none":
                known = ", ".join(TOOL_PARSERS)
                raise BadRequest(
                    "this model's chat template writes tool calls in a format the gateway does "
                    "not recognise, so they cannot be read: start the gateway with "
                    f"--tool-parser NAME (one of {known}) for the format the model writes, or "
                    "send tool_choice: none",
                    param="tools",
                )

    def held(self, prompts: list[Prompt], sp: SamplingParams) -> SamplingParams:
        """`sp`, with the grammar that holds a forced tool call's arguments to its tool's schema
        (`gateway.core.tool_grammars`) where the parser's format has one. The reply is then the
        call, so it replaces a response format (as OpenAI applies one to text replies only)."""
        [prompt] = prompts if len(prompts) == 1 else [None]
        if not isinstance(prompt, ChatPrompt):
            return sp
        choice = prompt.tool_choice
        if choice.mode not in ("required", "named"):
            return sp
        name = choice.name if choice.mode == "named" else None
        text = self._grammar(json.dumps(prompt.tools, sort_keys=True), name, choice.parallel)
        return sp if text is None else replace(sp, grammar=text, json_schema=None)

    def _held_grammar(self, tools: str, name: str | None, parallel: bool) -> str | None:
        """The forced call's grammar for `tools` (their JSON text, the cache's key), checked to
        compile; an agent sends the same tools every turn, so it is built once per core."""
        text = self.parsers.tools.grammar(json.loads(tools), name, parallel, self._marks)
        if text is None:
            return None
        try:
            lark_grammar(text)
        except GrammarError as exc:
            raise GrammarError(
                f"tool_choice forces a call, but its arguments cannot be held to the tools' "
                f"parameters: {exc}"
            ) from None
        return text

    async def start(
        self,
        spec: TurnSpec,
        session_id: str | None,
        *,
        run: RunConfig | None,
        retry: bool = False,
        exchange: Exchange | None = None,
        respond: Callable[[Turn, Choice], JSON],
    ) -> Turn:
        """Plan every prompt and start its choices; for a stream, return once the first piece
        was generated. `run`: the config of the session's run, which the request samples under
        (`gateway.core.sampling`; None outside a session). `retry`: the client says this repeats a
        request whose reply it never got (`gateway.core.segments`). `exchange`: the request's
        headers, which the run's side request rules read, and the answer's (`side_of`).
        `respond`: a choice's response JSON in the adapter's protocol, recorded with it."""
        self.check_tools(spec.prompts)
        side = side_of(spec, run, exchange)
        sp = self.held(spec.prompts, sampling_params(spec.asked, run))
        # A maximum the client did not ask for (the run's cap) is a limit, never a demand: where
        # the prompt leaves less room in the context, generate up to the room left.
        cap_to_context = spec.cap_to_context or spec.asked.max_new_tokens is None
        groups: list[Group] = []
        try:
            for prompt in spec.prompts:
                prefill = self.prefill(prompt) if isinstance(prompt, ChatPrompt) else ""
                ids, plan = await self._prompt(prompt, prefill, session_id, spec.n, retry)
                group = Group(prompt, prefill, ids, plan, [], self._opens(prompt, ids))
                groups.append(group)
                for req in choice_requests(sp, ids, spec.n, session_id, stream=spec.stream):
                    stream, bound = self._generate(req, cap_to_context)
                    group.runs.append(
                        ChoiceRun(
                            index=(len(groups) - 1) * spec.n + len(group.runs),
                            request=req,
                            stream=stream,
                            decoder=self._decoder(group, spec.stop),
                            context_bound=bound,
                        )
                    )
        except BaseException:
            self.release(groups)
            raise
        turn = Turn(
            self.context,
            spec,
            groups,
            sp,
            contract_of(run),
            respond,
            cap=max_tokens_cap(run),
            side=side,
        )
        if spec.stream:
            await turn.start_stream()
        return turn

    def _decoder(self, group: Group, stop: list[str]) -> IncrementalDecoder:
        """A choice's decoder: it holds back the parsers' markers while they may still start,
        and with one tool call allowed it stops at the end of the first (kept in the text)."""
        holdback = [*self.parsers.reasoning_markers]
        kept = frozenset[str]()
        if group.parses_tools:
            holdback += self.parsers.tools.markers
            end = self.parsers.tools.call_end
            prompt = group.prompt
            if (
                end is not None
                and isinstance(prompt, ChatPrompt)
                and not prompt.tool_choice.parallel
            ):
                stop, kept = [*stop, end], frozenset({end})
        tok = self.renderer.tokenizer
        return IncrementalDecoder(tok, stop, holdback=holdback, keep=self._keep, kept_stops=kept)

    def _generate(self, req: GenerateRequest, cap: bool) -> tuple[AsyncIterator[TokenChunk], bool]:
        """The engine's stream (`generate` validates: it raises before any token), and whether
        only the model's context bounds its length (no maximum, or one capped at the room)."""
        try:
            return self.engine.generate(req), req.sampling.max_new_tokens is None
        except PromptTooLongError as exc:
            room = exc.max_model_len - exc.prompt_len
            if not cap or room < 1:
                raise
            capped = replace(req, sampling=replace(req.sampling, max_new_tokens=room))
            return self.engine.generate(capped), True

    def release(self, groups: list[Group]) -> None:
        self.context.release(groups)

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
            fresh = functools.partial(
                r.prompt, prompt.messages, prompt.tools, prefill, prompt.template_kwargs
            )
            choose = functools.partial(_choose_chat, r, prompt, prefill, retry)
        if session_id is None or self.recorder is None:
            return await asyncio.to_thread(fresh), None
        plan = await self.recorder.plan(session_id, n, choose, fresh)
        return plan.prompt_ids, plan


def system_text(prompts: list[Prompt]) -> str:
    """The request's system prompt: its system messages (developer and instructions are
    normalized to them), joined by newlines; empty for token prompts."""
    return "\n".join(
        str(m.get("content") or "")
        for p in prompts
        if isinstance(p, ChatPrompt)
        for m in p.messages
        if m.get("role") == "system"
    )


def side_of(spec: TurnSpec, run: RunConfig | None, exchange: Exchange | None) -> str | None:
    """The run's side request rule that marks this request (`store.run_config`), said in the
    answer's `x-rlgateway-side` header; None: the agent's own turn (or no run)."""
    if run is None or not run.side_requests:
        return None
    headers = {} if exchange is None else exchange.headers
    side = run.side_rule(system_text(spec.prompts), spec.asked.max_new_tokens, headers)
    if side is not None and exchange is not None:
        exchange.answer_headers[SIDE_HEADER] = side
    return side


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
        if extends(transcript, prompt.messages, prompt.tools, prompt.template_kwargs):
            render = functools.partial(
                r.continuation,
                seg.tokens,
                transcript["messages"],
                prompt.messages,
                prompt.tools,
                prefill,
                prompt.template_kwargs,
            )
            return Match(seg, render)
        last = seg.replaceable(retry=retry)
        if last is not None and _repeats(seg, last, prompt, prefill):
            return Match(seg, functools.partial(list, seg.tokens[: last.prompt_len]), last)
    return None


def _repeats(seg: LiveSegment, last: LastTurn, prompt: ChatPrompt, prefill: str) -> bool:
    """The request is the one `last` answered, so its prompt is `last`'s."""
    return repeats(seg.transcript, prompt.messages, prompt.tools, prompt.template_kwargs) and (
        recorded_prefill(last.request) == prefill
    )
