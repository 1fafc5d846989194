"""One generated choice: drives an engine stream token by token, applies stop strings, and keeps
the exact sampled ids, behaviour logprobs and versions (truncated where a stop string matched).

`RunGroup` drives a request's choices together. A stream starts it and waits for the first piece
(`start`) before it answers, so a failure before any token (the engine unavailable, a request it
refuses) is an HTTP error; a failure after it is the protocol's error event (OpenAI's:
`gateway.protocols.openai.sse.sse_error`), as OpenAI and vLLM send it. The protocols format the
choices (logprob entries, events); nothing here knows a wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import GenerateRequest, TokenChunk
from gateway.core.detok import IncrementalDecoder


@dataclass(eq=False, slots=True)
class ChoiceRun:
    index: int
    request: GenerateRequest
    stream: AsyncIterator[TokenChunk]
    decoder: IncrementalDecoder
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    context_bound: bool = False
    """Only the model's context bounds its length (the client and the run set no lower limit):
    a `length` finish is the context's end (`Choice.context_edge`)."""
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

    async def run(self, on_progress: Callable[[ChoiceRun], None] | None = None) -> None:
        """Consume the engine stream to its end (or to a stop string, which aborts it)."""
        async with contextlib.aclosing(self.stream) as stream:  # type: ignore[type-var]
            async for chunk in stream:
                self._take(chunk)
                if on_progress is not None:
                    on_progress(self)
                if self.finish_reason is not None:
                    return

    def _take(self, chunk: TokenChunk) -> None:
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for j, tok in enumerate(chunk.token_ids):
            self.decoder.push(tok)
            self.logprobs.append(chunk.logprobs[j])
            self.versions.append(chunk.versions[j])
            if chunk.top_logprobs:
                self.top_logprobs.append(chunk.top_logprobs[j])
            if self.decoder.stopped:
                self.finish_reason = "stop"
                return
        if chunk.finish_reason is not None:
            self.decoder.flush()
            self.finish_reason = chunk.finish_reason.value

    def mark_aborted(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"

    @property
    def latency_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started) * 1000


@dataclass(frozen=True, slots=True)
class EventStream:
    """A started stream: its server-sent events, and `close`, which stops it in whatever state it
    is (recording the turn, aborted, unless it finished). The response calls `close` when it
    ends, even if its events were never read (a client gone before the first one)."""

    events: AsyncIterator[str]
    close: Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Ended:
    error: Exception | None


class RunGroup:
    """Drives a request's choices concurrently and reports each run whenever it has new tokens
    (the streaming routes turn these into SSE chunks)."""

    def __init__(self, runs: list[ChoiceRun]) -> None:
        self.runs = runs
        self._queue: asyncio.Queue[ChoiceRun | _Ended] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0
        self._first: ChoiceRun | _Ended | None = None

    async def _drive(self, run: ChoiceRun) -> None:
        try:
            await run.run(on_progress=self._queue.put_nowait)
        except Exception as exc:  # reported to whoever reads the group, and raised there
            self._queue.put_nowait(_Ended(exc))
        else:
            self._queue.put_nowait(_Ended(None))

    def _launch(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._drive(r)) for r in self.runs]
            self._running = len(self.runs)

    async def start(self) -> None:
        """Start every run and wait for the first piece of any (or the end of one); re-raise a
        run's failure before that."""
        self._launch()
        first = await self._queue.get()
        if isinstance(first, _Ended) and first.error is not None:
            raise first.error
        self._first = first

    async def progress(self) -> AsyncIterator[ChoiceRun]:
        """Yield runs as they progress until every run has ended; re-raise a run's failure as
        soon as it happens."""
        self._launch()
        while self._running:
            event = self._first if self._first is not None else await self._queue.get()
            self._first = None
            if isinstance(event, _Ended):
                self._running -= 1
                if event.error is not None:
                    raise event.error
                continue
            yield event

    async def wait(self) -> None:
        """Run every choice to its end; re-raise the first failure."""
        async for _ in self.progress():
            pass

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()

    async def settle(self) -> None:
        """Wait until every run has stopped (after `cancel`), whatever it raised."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenPieces:
    """Each token id's text and its exact bytes, for OpenAI logprobs (cached per id).

    With a byte-level tokenizer a token may be part of a UTF-8 character: its text then shows
    U+FFFD, but its bytes are the raw ones, so a client can join them back into characters.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._bytes_of = _byte_decoder()
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            raw = list(text.encode("utf-8"))
            if self._byte_level and token_id not in self._added:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if all(ch in self._bytes_of for ch in piece):
                    raw = [self._bytes_of[ch] for ch in piece]
            hit = self._cache[token_id] = (text, raw)
        return hit
