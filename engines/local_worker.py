"""The local engine's worker: one thread that owns the model and schedules it (continuous batching).

Each iteration it (1) applies aborts, (2) applies pending weight updates, (3) unless paused,
prefills newly arrived requests into free KV slots and samples their first token, and (4) runs one
batched decode step over every live sequence. Requests therefore join and leave between decode
steps. A step admits waiting requests in arrival order up to `max_prefill_tokens` prompt tokens
(at least one request), as SGLang's `--max-prefill-tokens` does: a burst of long prompts is
prefilled over several steps, each followed by a decode step of the live sequences and open to a
weight update, instead of all of it holding both back. Torch releases the GIL inside its
kernels, so a caller's event loop keeps running while a step computes. Its API is synchronous and
thread-safe (`submit`, `abort_now`, `set_paused`, `submit_update`, `health_now`, `close_now`):
`engines.local.LocalEngine` puts asyncio in front of it, `engines.process_main` a pipe.

Weight swaps happen between steps. After a swap every live sequence goes back to the head of the
queue and is prefilled again, whole, under the new weights (its old KV cache dropped), within the
steps' prefill budget like new prompts: so every token sampled after the swap carries the new
version *and* its logprob is exactly the new policy's (a teacher-forced pass with the new weights
reproduces it), and a swap waits only for the step in progress, not for the recompute.

Each step's output goes to its consumers in one call per consumer (`Consumer.deliver`).

Faults are contained to the requests they concern. Requests are checked before they are queued
(`engines.limits.check_local_request`), but whatever still raises while one step serves them
fails only what it can be pinned on: a batch whose prefill or sampling raises is redone one
sequence at a time, and a sequence that fails alone gets `RequestFailedError` while the rest of
the batch goes on. A fault that no request explains (the decode forward itself) fails the
sequences of that step and is logged; the worker goes on, and only `MAX_FAILED_STEPS` failed steps
in a row stop it (the engine then reports itself failed; `engines.process` restarts it). A weight
update is checked whole (`engines.weights`: files, names, shapes, dtypes, finite values, version)
before the first tensor is copied, so a refused one changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engines.base import (
    EngineHealth,
    FinishReason,
    GenerateRequest,
    TokenChunk,
    WeightUpdate,
    join_chunks,
)
from engines.constraint import Constraint, Grammars
from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    WeightUpdateError,
)
from engines.sampling import behaviour_logprobs, sample, truncate
from engines.slot_model import SlotModel
from engines.weights import checked_weights

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3
"""Steps in a row that may fail before the worker stops: one failed step is a fault of that
step (its sequences fail, the engine goes on); several in a row mean the engine is broken."""

RETRY_AFTER_S = 1.0
"""The `retry_after` of a request that failed on a fault of the engine's step."""


@dataclass(slots=True)
class EngineStats:
    """Counters the engine keeps about its own batching (read them, don't time them)."""

    decode_steps: int = 0
    decode_tokens: int = 0
    """Sum over decode steps of the batch size: tokens produced by decode steps."""
    max_decode_batch: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_steps: int = 0
    """Steps that admitted (and prefilled) new requests."""
    max_step_prefill_tokens: int = 0
    """The most prompt tokens one step admitted."""
    weight_updates: int = 0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0


_Item = TokenChunk | BaseException


_Row = tuple[int, float, tuple[tuple[tuple[int, float], ...], ...]]
"""One sampled row: token id, behaviour logprob, top logprobs (empty unless asked for)."""


class _EngineBroken(Exception):
    """Raised in the worker when the engine cannot go on (its weights are mixed, or too many steps
    in a row failed): the worker stops and every request fails with `EngineUnavailableError`."""


class Consumer(Protocol):
    """Receives one step's output for the sequences it submitted. Called on the worker thread,
    once per step with everything that step produced for it, in order; must not block long."""

    def deliver(self, items: list[tuple[str, _Item]]) -> None:
        """`items` are (request id, chunk or error); a chunk with a finish reason, or an error,
        is the last item of its request."""
        ...


@dataclass(eq=False, slots=True)
class _Seq:
    request: GenerateRequest
    tokens: list[int]
    prompt_len: int
    max_new: int
    stops: frozenset[int]
    generator: torch.Generator | None
    consumer: Consumer
    slot: int = -1
    done: bool = False
    held: list[TokenChunk] = field(default_factory=list)
    """Sampled chunks not yet delivered (`GenerateRequest.stream_interval`)."""
    constraint: Constraint | None = None
    """The grammar the output must follow (`SamplingParams.json_schema`)."""

    @property
    def num_new(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True)
class _Update:
    update: WeightUpdate
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)


class LocalWorker:
    """The thread that owns `model` (module docstring). Thread-safe; stopped by `close_now`."""

    def __init__(
        self,
        model: Any,
        *,
        model_dir: str,
        max_batch: int,
        max_model_len: int,
        version: int,
        eos_token_ids: frozenset[int],
        max_prefill_tokens: int = 512,
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.runner = SlotModel(model, max_slots=max_batch, max_model_len=max_model_len)
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(model_dir, self.runner.vocab_size)
        self.stats = EngineStats()
        self._rng = torch.Generator(device=self.runner.device)
        self._rng.manual_seed(secrets.randbits(63))
        self._version = version
        self._cv = threading.Condition()
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._live: dict[str, _Seq] = {}
        self._aborts: set[str] = set()
        self._updates: list[_Update] = []
        self._paused = False
        self._closed = False
        self._failure: BaseException | None = None
        self._failed_steps = 0
        """Steps in a row that failed (`MAX_FAILED_STEPS`)."""
        self._step_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name="rlgateway-local-engine", daemon=True
        )
        self._thread.start()

    def version(self) -> int:
        return self._version

    def submit(self, request: GenerateRequest, consumer: Consumer) -> None:
        """Queue a checked request; its output goes to `consumer`. Raises
        `EngineUnavailableError` when closed and `InvalidRequestError` for a live id."""
        seq = self._make_seq(request, consumer)
        with self._cv:
            self._check_open()
            if request.request_id in self._live:
                raise InvalidRequestError(f"request id {request.request_id!r} is already live")
            self._live[request.request_id] = seq
            self._waiting.append(seq)
            self._cv.notify()

    def _make_seq(self, request: GenerateRequest, consumer: Consumer) -> _Seq:
        sp = request.sampling
        n_prompt = len(request.prompt_ids)
        room = self.max_model_len - n_prompt
        stops = frozenset(sp.stop_token_ids) | (
            frozenset() if sp.ignore_eos else self.eos_token_ids
        )
        generator = None  # unseeded rows are drawn together from the engine's generator
        if sp.temperature > 0 and sp.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(sp.seed % 2**64)
        return _Seq(
            request=request,
            tokens=list(request.prompt_ids),
            prompt_len=n_prompt,
            max_new=min(sp.max_new_tokens or room, room),
            stops=stops,
            generator=generator,
            consumer=consumer,
            constraint=self.grammars.matcher(sp.json_schema, sp.grammar),
        )

    def abort_now(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._live:
                self._aborts.add(request_id)
                self._cv.notify()

    def set_paused(self, paused: bool) -> None:
        with self._cv:
            self._paused = paused
            self._cv.notify()

    def wait_step(self) -> None:
        """Block until the step in progress (if any) has finished."""
        with self._step_lock:
            pass

    def submit_update(self, update: WeightUpdate) -> concurrent.futures.Future[int]:
        """Queue a weight swap; the future resolves to the new version between two steps."""
        pending = _Update(update)
        with self._cv:
            self._check_open()
            self._updates.append(pending)
            self._cv.notify()
        return pending.future

    def health_now(self) -> EngineHealth:
        with self._cv:
            ok = not self._closed and self._failure is None
            detail = "" if ok else repr(self._failure or "closed")
            return EngineHealth(
                ok=ok,
                paused=self._paused,
                version=self._version,
                running=len(self._running),
                waiting=len(self._waiting),
                detail=detail,
            )

    def wait_stopped(self) -> BaseException | None:
        """Block until the worker has stopped (closed, or failed); return its failure, if any."""
        self._thread.join()
        with self._cv:
            return self._failure

    def close_now(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the worker --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineUnavailableError(f"the local engine failed: {self._failure!r}")
        if self._closed:
            raise EngineUnavailableError("the local engine is closed")

    def _has_work(self) -> bool:
        if self._closed or self._aborts or self._updates:
            return True
        return not self._paused and bool(self._running or self._waiting)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._closed:
                        break
                    aborts, self._aborts = self._aborts, set()
                    updates, self._updates = self._updates, []
                    dropped = [s for s in self._waiting if s.request.request_id in aborts]
                    self._waiting = [s for s in self._waiting if s.request.request_id not in aborts]
                    admitted: list[_Seq] = []
                    if not self._paused:
                        free = self.max_batch - len(self._running)
                        n = _admitted(self._waiting[:free], self.max_prefill_tokens)
                        admitted, self._waiting = self._waiting[:n], self._waiting[n:]
                with self._step_lock:
                    self._guarded_step(aborts, dropped, updates, admitted)
        except BaseException as exc:
            log.exception("the local engine's worker failed")
            with self._cv:
                self._failure = exc
        finally:
            self._shutdown()

    def _guarded_step(
        self, aborts: set[str], dropped: list[_Seq], updates: list[_Update], admitted: list[_Seq]
    ) -> None:
        """One step; a fault no request explains fails that step's sequences (and its pending
        updates) and is logged, and the worker goes on unless `MAX_FAILED_STEPS` failed in a
        row (then it raises, and the engine fails)."""
        out = _Outbox()
        try:
            self._step(aborts, dropped, updates, admitted, out)
        except _EngineBroken:
            raise
        except Exception as exc:
            self._failed_steps += 1
            with self._cv:  # a swap may have put some of `admitted` back: the step did not run them
                queued = {id(s) for s in self._waiting}
            seqs = {
                id(s): s
                for s in [*dropped, *admitted, *self._running]
                if not s.done and id(s) not in queued
            }
            log.exception(
                "an engine step failed (%d in a row); its %d sequences fail",
                self._failed_steps,
                len(seqs),
            )
            error = RequestFailedError(
                f"the engine failed while serving this request ({exc!r}); the engine goes on: "
                "send the request again",
                retry_after=RETRY_AFTER_S,
            )
            for seq in seqs.values():
                self._fail(seq, error, out)
            self._running = []
            for upd in updates:
                if not upd.future.done():
                    upd.future.set_exception(
                        EngineUnavailableError(
                            f"the engine step failed before this weight update was applied "
                            f"({exc!r}); nothing was changed: send it again",
                            retry_after=RETRY_AFTER_S,
                        )
                    )
            if self._failed_steps >= MAX_FAILED_STEPS:
                broken = _EngineBroken(f"{self._failed_steps} engine steps in a row failed")
                with self._cv:  # before the requests hear of it, so health says so at once
                    self._failure = broken
                raise broken from exc
        else:
            self._failed_steps = 0
        finally:
            out.flush()

    def _step(
        self,
        aborts: set[str],
        dropped: list[_Seq],
        updates: list[_Update],
        admitted: list[_Seq],
        out: _Outbox,
    ) -> None:
        for seq in [*dropped, *self._running]:
            if seq.request.request_id in aborts:
                self._finish(seq, FinishReason.ABORT, out)
        self._compact()
        version = self._version
        for upd in updates:
            self._apply_update(upd)
        if self._version != version and self._running:
            admitted = self._requeue_live(admitted)
        if admitted:
            tokens = sum(len(seq.tokens) for seq in admitted)
            self.stats.prefill_steps += 1
            self.stats.max_step_prefill_tokens = max(self.stats.max_step_prefill_tokens, tokens)
        for group in _prefill_groups(admitted, PREFILL_TOKEN_BUDGET):
            self._prefill(group, out)
        self._compact()
        if self._running:
            batch = list(self._running)
            logits_BV = self.runner.decode(
                [s.tokens[-1] for s in batch], [len(s.tokens) - 1 for s in batch]
            )
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(batch)
            self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(batch))
            self._sample(batch, logits_BV, out)
            self._compact()

    def _requeue_live(self, admitted: list[_Seq]) -> list[_Seq]:
        """After a weight swap: every live sequence goes back to the head of the queue, ahead of
        this step's admissions, to be prefilled again whole (the KV cache of the old weights is
        dropped, as AReaL's interruptible rollout does) and sample its next token under the new
        weights; then this step admits from the head within the prefill budget. So a publish
        waits for the step in progress and the copy, not for the recompute of every history,
        which is spread over the next steps like a burst of new prompts."""
        live, self._running = self._running, []
        for seq in live:
            seq.slot = -1
        with self._cv:
            queue = [*live, *admitted, *self._waiting]
            n = 0 if self._paused else _admitted(queue[: self.max_batch], self.max_prefill_tokens)
            admitted, self._waiting = queue[:n], queue[n:]
        return admitted

    def _prefill(self, group: list[_Seq], out: _Outbox) -> None:
        """Prefill `group` into the next free slots and sample each one's first token. A forward
        that raises is redone one sequence at a time, so that only a sequence that fails alone
        fails."""
        first = len(self._running)
        for i, seq in enumerate(group):
            seq.slot = first + i
            self._running.append(seq)
        self._prefill_slots(group, out)

    def _prefill_slots(self, group: list[_Seq], out: _Outbox) -> None:
        """`_prefill` on sequences that hold consecutive slots already."""
        try:
            logits_BV = self.runner.prefill_batch(group[0].slot, [seq.tokens for seq in group])
        except Exception as exc:
            if len(group) == 1:
                self._fail(group[0], self._request_failed(exc), out)
                return
            log.warning(
                "a prefill of %d sequences failed (%r); redoing each alone", len(group), exc
            )
            for seq in group:
                self._prefill_slots([seq], out)
            return
        self.stats.prefills += len(group)
        self.stats.prefill_tokens += sum(len(seq.tokens) for seq in group)
        self._sample(group, logits_BV, out)

    def _sample(self, batch: list[_Seq], logits_BV: torch.Tensor, out: _Outbox) -> None:
        """Sample one token per sequence and deliver it. If sampling the batch raises, each
        sequence is sampled alone and those that fail alone fail."""
        try:
            drawn = self._draw(batch, logits_BV)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], self._request_failed(exc), out)
                return
            log.warning("sampling %d sequences failed (%r); sampling each alone", len(batch), exc)
            for b, seq in enumerate(batch):
                self._sample([seq], logits_BV[b : b + 1], out)
            return
        version = self._version
        for seq, row in zip(batch, drawn, strict=True):
            if isinstance(row, str):
                self._fail(seq, RequestFailedError(row, retry_after=RETRY_AFTER_S), out)
                continue
            tok, lp, top = row
            if seq.constraint is not None and tok not in seq.stops:
                try:
                    seq.constraint.accept(tok)
                except Exception as exc:
                    self._fail(seq, self._request_failed(exc), out)
                    continue
            seq.tokens.append(tok)
            finish = None
            if tok in seq.stops or (
                seq.constraint is not None and seq.constraint.done and not seq.stops
            ):
                finish = FinishReason.STOP  # (the JSON is complete and no end token may follow)
            elif seq.num_new >= seq.max_new:
                finish = FinishReason.LENGTH
            seq.held.append(TokenChunk((tok,), (lp,), (version,), finish, top))
            first = seq.num_new == 1  # never held: the consumer times the first token
            if first or finish is not None or len(seq.held) >= seq.request.stream_interval:
                out.put(seq, join_chunks(seq.held))
                seq.held.clear()
            if finish is not None:
                self._finish(seq, finish, out, announce=False)

    def _draw(self, batch: list[_Seq], logits_BV: torch.Tensor) -> list[_Row | str]:
        """The tensor work of sampling, changing no sequence: per row, (token, behaviour logprob,
        top logprobs), or why that row cannot be sampled (no finite distribution to draw from)."""
        dev = logits_BV.device
        vocab = logits_BV.shape[-1]
        sps = [s.request.sampling for s in batch]
        masks = [(b, s.constraint.allowed(s.stops)) for b, s in enumerate(batch) if s.constraint]
        if masks:  # the grammar first: a constrained token's behaviour logprob is the masked one
            logits_BV = logits_BV.clone()
            for b, allow_V in masks:
                logits_BV[b].masked_fill_(~allow_V.to(dev), float("-inf"))
        logp_BV = behaviour_logprobs(
            logits_BV, torch.tensor([sp.temperature for sp in sps], device=dev)
        )
        draw_BV = logp_BV
        banned = [(b, s.stops) for b, s in enumerate(batch) if s.num_new < sps[b].min_new_tokens]
        if banned:
            draw_BV = draw_BV.clone()
            for b, stops in banned:
                draw_BV[b, list(stops)] = float("-inf")
        if any(sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0) for sp in sps):
            draw_BV = truncate(
                draw_BV,
                torch.tensor([min(sp.top_k, vocab) for sp in sps], device=dev),
                torch.tensor([sp.top_p for sp in sps], device=dev),
            )
        # A row with a NaN or +inf, or with nothing left to draw, would fail the draw of the
        # whole batch: it draws from a uniform row instead and fails alone (max is NaN over a
        # row with a NaN, inf with a +inf, -inf with nothing left).
        bad_B = ~torch.isfinite(draw_BV.amax(dim=-1))
        draw_BV = draw_BV.masked_fill(bad_B[:, None], 0.0)
        tokens_B = sample(
            draw_BV,
            greedy_B=[sp.temperature == 0 for sp in sps],
            generators=[s.generator for s in batch],
            shared=self._rng,
        )
        chosen_B = logp_BV.gather(-1, tokens_B[:, None])[:, 0]
        k = min(max(sp.top_logprobs for sp in sps), vocab)
        tops: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            values_BK, ids_BK = logp_BV.topk(k, dim=-1)
            tops, top_ids = values_BK.tolist(), ids_BK.tolist()
        rows: list[_Row | str] = []
        for b, (tok, lp, bad) in enumerate(
            zip(tokens_B.tolist(), chosen_B.tolist(), bad_B.tolist(), strict=True)
        ):
            if bad:
                rows.append(
                    "nothing to sample for this request: every token is excluded (min_tokens "
                    "masks its stop ids, or its JSON schema allows no token here) or the model's "
                    "logits are not finite; the engine goes on"
                )
                continue
            n_top = sps[b].top_logprobs
            top = (tuple(zip(top_ids[b][:n_top], tops[b][:n_top], strict=True)),) if n_top else ()
            rows.append((tok, lp, top))
        return rows

    def _request_failed(self, exc: Exception) -> RequestFailedError:
        log.warning("a request failed in the engine: %r", exc)
        return RequestFailedError(
            f"the engine failed while serving this request ({exc!r}); the engine goes on",
            retry_after=RETRY_AFTER_S,
        )

    def _fail(self, seq: _Seq, error: BaseException, out: _Outbox) -> None:
        """End `seq` with `error` (its held tokens first); a finished sequence is left alone."""
        if seq.done:
            return
        seq.done = True
        with self._cv:
            self._live.pop(seq.request.request_id, None)
        if seq.held:
            out.put(seq, join_chunks(seq.held))
            seq.held.clear()
        out.put(seq, error)

    def _finish(
        self, seq: _Seq, reason: FinishReason, out: _Outbox, *, announce: bool = True
    ) -> None:
        seq.done = True
        with self._cv:
            self._live.pop(seq.request.request_id, None)
        if announce:
            out.put(seq, join_chunks([*seq.held, TokenChunk((), (), (), reason)]))
            seq.held.clear()

    def _compact(self) -> None:
        """Drop finished sequences; the last live ones move into the freed slots."""
        running = self._running
        i = 0
        while i < len(running):
            if not running[i].done:
                i += 1
                continue
            last = running.pop()
            if i < len(running):
                if not last.done:
                    self.runner.move_slot(last.slot, i, len(last.tokens) - 1)
                last.slot = i
                running[i] = last

    def _apply_update(self, upd: _Update) -> None:
        """Check the update whole, then swap it in; its future is resolved either way. A failure
        after the first tensor was copied leaves mixed weights: the engine stops (`_EngineBroken`)
        rather than serve them."""
        try:
            version, state = checked_weights(self.model, upd.update, current=self._version)
        except Exception as exc:
            if not isinstance(exc, WeightUpdateError):
                exc = WeightUpdateError(f"the new weights could not be loaded: {exc!r}")
            log.warning("refused a weight update: %s", exc)
            upd.future.set_exception(exc)
            return
        try:
            self._copy_in(state)
        except Exception as exc:
            upd.future.set_exception(
                EngineUnavailableError(f"the engine failed while swapping in the weights: {exc!r}")
            )
            raise _EngineBroken("a weight swap failed half-way") from exc
        self._version = version
        self.stats.weight_updates += 1
        upd.future.set_result(version)

    def _copy_in(self, state: Mapping[str, torch.Tensor]) -> None:
        known = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state.items():
                known[name].copy_(tensor)
        self.runner.repack()

    def _shutdown(self) -> None:
        with self._cv:
            self._closed = True
            seqs = [*self._running, *self._waiting, *self._live.values()]
            updates, self._updates = self._updates, []
            failure = self._failure
        out = _Outbox()
        for seq in {id(s): s for s in seqs}.values():
            if seq.done:
                continue
            seq.done = True
            if failure is not None:
                out.put(seq, EngineUnavailableError(f"the local engine failed: {failure!r}"))
            else:
                out.put(seq, join_chunks([*seq.held, TokenChunk((), (), (), FinishReason.ABORT)]))
        for upd in updates:
            upd.future.set_exception(EngineUnavailableError("the local engine closed"))
        self._running, self._waiting = [], []
        with self._cv:
            self._live.clear()
        out.flush()


def _admitted(waiting: list[_Seq], max_tokens: int) -> int:
    """How many of `waiting` (in arrival order) one step admits: as many as fit `max_tokens`
    prompt tokens together, and the first one always (a prompt longer than the budget is
    prefilled alone rather than never)."""
    total = 0
    for n, seq in enumerate(waiting):
        total += len(seq.tokens)
        if total > max_tokens and n > 0:
            return n
    return len(waiting)


PREFILL_TOKEN_BUDGET = 8192
"""Padded tokens (batch x longest prompt) per prefill forward."""


def _prefill_groups(seqs: list[_Seq], budget: int) -> list[list[_Seq]]:
    """Consecutive groups of new sequences whose padded prefill fits `budget` tokens."""
    groups: list[list[_Seq]] = []
    longest = 0
    for seq in seqs:
        n = len(seq.tokens)
        if groups and max(longest, n) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(seq)
            longest = max(longest, n)
        else:
            groups.append([seq])
            longest = n
    return groups


class _Outbox:
    """Collects one step's output and hands it to each consumer in one call."""

    def __init__(self) -> None:
        self._by_consumer: dict[Consumer, list[tuple[str, _Item]]] = defaultdict(list)

    def put(self, seq: _Seq, item: _Item) -> None:
        self._by_consumer[seq.consumer].append((seq.request.request_id, item))

    def flush(self) -> None:
        for consumer, items in self._by_consumer.items():
            consumer.deliver(items)
        self._by_consumer.clear()
