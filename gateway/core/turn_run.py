"""One turn in flight (`Turn`): its choices' runs, their commit, and their neutral results, whole
or as deltas while they stream. `gateway.core.turn.TurnCore` starts it with its `TurnContext`;
the adapters read it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from engines.base import SamplingParams
from gateway.core.call_stream import CallScanner
from gateway.core.choices import ChoiceRun, RunGroup
from gateway.core.reasoning_parsers import Split
from gateway.core.recorder import ChoiceOutcome
from gateway.core.sampling import record_of
from gateway.core.segments import chat_transcript
from gateway.core.tool_parsers.base import new_call_id
from gateway.core.turn_types import (
    COMPLETION_TRANSCRIPT,
    RECORD_KEY,
    CallDelta,
    ChatPrompt,
    Choice,
    Delta,
    Group,
    Prompt,
    TokenPrompt,
    ToolCall,
    TurnContext,
    TurnSpec,
    parse_arguments,
)
from store.run_config import ClientSampling
from store.types import JSON, TurnStatus


class Turn:
    """One request in flight: its choices' runs, their commit, and their neutral results."""

    def __init__(
        self,
        context: TurnContext,
        spec: TurnSpec,
        groups: list[Group],
        sampling: SamplingParams,
        contract: ClientSampling,
        respond: Callable[[Turn, Choice], JSON],
        *,
        cap: int | None,
        side: str | None = None,
    ) -> None:
        self.context = context
        """What it reads of the core that started it."""
        self.spec = spec
        self.groups = groups
        self.sampling = sampling
        self.contract = contract
        self.cap = cap
        """The run's cap on new tokens (`gateway.core.sampling.max_tokens_cap`), recorded."""
        self.side = side
        """The run's side request rule the request matched (`store.run_config`), recorded."""
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
        self.argued: dict[int, int] = {}
        self._scanners: dict[int, CallScanner] = {}
        """Per choice, the reading of its forced call so far (`_streamed_call`)."""
        """How much of each streamed forced call's arguments was sent, by choice."""

    # -- results -----------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """The model name the answer gives: the one the client asked for (as a proxy echoes it;
        the gateway serves one model whatever the name), else the served model's."""
        asked = self.spec.request.get("model")
        return asked if isinstance(asked, str) and asked else self.context.model_name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(g.ids) for g in self.groups)

    @property
    def completion_tokens(self) -> int:
        return sum(len(r.ids) for r in self.runs)

    @property
    def reasoning_tokens(self) -> int:
        """Sampled tokens of the choices' reasoning (OpenAI's `reasoning_tokens`): each reply's
        tokens up to the one that ends its reasoning, all of one whose reasoning never ended."""
        return sum(self._reasoning_tokens(r) for r in self.runs)

    def _reasoning_tokens(self, run: ChoiceRun) -> int:
        group, ids = self._group_of(run), run.ids

        def ended(k: int) -> bool:
            raw = b"".join(bytes(self.context.pieces(t)[1]) for t in ids[:k])
            split = self._split(group, group.prefill + raw.decode("utf-8", errors="replace"))
            return split.reasoning is not None and split.done

        whole = self._split(group, self.full_text(run))
        if whole.reasoning is None:
            return 0
        if not ended(len(ids)):
            return len(ids)
        lo, hi = 0, len(ids)  # the fewest tokens after which the reasoning has ended
        while lo < hi:
            mid = (lo + hi) // 2
            if ended(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def completion_id(self, i: int) -> str:
        return self.id if len(self.runs) == 1 else f"{self.id}-{i}"

    def _group_of(self, run: ChoiceRun) -> Group:
        return self.groups[run.index // self.spec.n]

    def full_text(self, run: ChoiceRun) -> str:
        return self._group_of(run).prefill + run.decoder.text

    def _split(self, group: Group, text: str) -> Split:
        reasoning = self.context.parsers.reasoning
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
            cut = [at for m in self.context.parsers.tools.markers if (at := text.find(m)) >= 0]
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
            tools = group.prompt.tools if isinstance(group.prompt, ChatPrompt) else []
            content, parsed = self.context.parsers.tools.parse(split.answer, tools)
            ids = self._call_ids.setdefault(run.index, [])
            style = self.context.parsers.tools.call_ids
            while len(ids) < len(parsed):  # the model's own id where its format writes one
                ids.append(parsed[len(ids)].id or new_call_id(style))
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
            context_edge=finish == "length" and run.context_bound,
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
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": parse_arguments(c.arguments)},
                }
                for c in choice.tool_calls
            ]
        return chat_transcript([*prompt.messages, reply], prompt.tools, prompt.template_kwargs)

    async def _commit(self, aborted: bool) -> None:
        recorder = self.context.recorder
        if recorder is None or self.committed:
            return
        self.committed = True
        choices = self._finish(aborted)
        sampling = record_of(self.sampling, self.contract, self.cap) | self.spec.sampling_extra
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
                        status=TurnStatus.ABORTED
                        if aborted or (choice.context_edge and self.spec.edge_is_error)
                        else TurnStatus.OK,
                        response=self.respond(self, choice),
                        latency_ms=r.latency_ms,
                        ttft_ms=r.ttft_ms,
                    )
                )
            await recorder.commit(g.plan, outcomes, sampling, request, side=self.side)

    def _release(self) -> None:
        if not self.committed:
            self.committed = True
            self.context.release(self.groups)

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
            call = self._call_delta(run)
            lo, hi = sent_tokens[i], len(run.ids)
            sent_tokens[i] = hi
            if new or thought or hi > lo or call is not None:
                yield Delta(run, new, thought, lo, hi, call)
        await self._commit(aborted=False)
        self._finish(aborted=False)

    def _streamed_call(self, run: ChoiceRun, text: str) -> tuple[str, str] | None:
        """(name, arguments written so far) of the first call of a reply forced to call a tool
        under its grammar, in a format of JSON arguments (`call_stream`); None for any other."""
        group = self._group_of(run)
        prompt, parser = group.prompt, self.context.parsers.tools
        if not isinstance(prompt, ChatPrompt) or self.sampling.grammar is None:
            return None
        choice = prompt.tool_choice
        if choice.mode not in ("named", "required") or not parser.json_arguments:
            return None
        scanner = self._scanners.get(run.index)
        if scanner is None:
            names = (
                [choice.name]
                if choice.mode == "named"
                else [str(t["function"]["name"]) for t in prompt.tools]
            )
            scanner = self._scanners[run.index] = CallScanner(names, parser.prefill)
        return scanner.scan(text[len(prompt.continues) :])

    def _call_delta(self, run: ChoiceRun) -> CallDelta | None:
        group = self._group_of(run)
        found = self._streamed_call(run, group.prefill + run.decoder.safe_text())
        sent = self.argued.get(run.index)
        if found is None or len(found[1]) <= (sent or 0):
            return None
        name, arguments = found
        ids = self._call_ids.setdefault(run.index, [])
        if not ids:
            ids.append(new_call_id(self.context.parsers.tools.call_ids))
        self.argued[run.index] = len(arguments)
        return CallDelta(ids[0], name, arguments[sent or 0 :], sent is None)

    def unsent_arguments(self, choice: Choice) -> str | None:
        """The part of the streamed first call's arguments not yet sent (None: no call was
        streamed; the calls go whole in the last chunk)."""
        sent = self.argued.get(choice.index)
        if sent is None:
            return None
        found = self._streamed_call(choice.run, self.full_text(choice.run))
        return "" if found is None else found[1][sent:]

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


def _continues(group: Group) -> str:
    return group.prompt.continues if isinstance(group.prompt, ChatPrompt) else ""


def _more(text: str, sent: list[int], i: int) -> str:
    """What `text` adds to the `sent[i]` characters already sent (and count it sent)."""
    if len(text) <= sent[i]:
        return ""
    new, sent[i] = text[sent[i] :], len(text)
    return new
