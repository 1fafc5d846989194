"""What the HTTP engine adapters (vLLM, SGLang) share: interrupt-and-resume across weight updates.

A remote server generates one *sub-request* at a time for each of our requests. A weight update
(or `pause`) goes like this:

1. Close the gate: no new sub-request is sent.
2. Wait (briefly) until every sub-request already sent has been seen by the server (its first
   event arrived). Otherwise a request still on the wire could reach a paused vLLM 0.32 server,
   wait there, and run under the *new* weights while we stamped it with the old version.
3. Pause the server in abort mode: every running sub-request ends with finish reason `abort` and
   its partial tokens, which were all sampled under the old weights.
4. Load the weights, reset the prefix cache, label the server with the new version.
5. Open the gate: each interrupted request is sent again as prompt + the tokens it has so far,
   with the remaining token budget, and its later tokens carry the new version.

So every token carries the version of the weights that sampled it, and its logprob is the new
policy's exactly (the resubmitted prefix is recomputed, since the prefix cache was reset).

Requests that reach a paused server from elsewhere block (vLLM 0.32, SGLang) or get 503 (vLLM
0.33): `ServerPaused` makes the adapter wait for the gate and send again; no lock is held
across the pause that assumes either behaviour.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from engines.base import (
    Broadcast,
    EngineHealth,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenChunk,
    WeightGroup,
    WeightUpdate,
)
from engines.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    TokenOutOfRangeError,
    WeightUpdateError,
)
from engines.http import EngineHTTP

log = logging.getLogger(__name__)

STARTED_GRACE_S = 5.0
"""How long a weight update waits for sub-requests on the wire to reach the server."""
PAUSED_RETRY_S = 0.05
"""Back-off before resending a sub-request that a paused server refused (503)."""
CLOSE_S = 10.0
"""How long `close` waits for the streams it aborted to take their last piece."""


@dataclass(frozen=True, slots=True)
class Piece:
    """What a server streamed since the last piece. Lists share one length; `finish` is set on
    the last piece of a sub-request only."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    finish: FinishReason | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteEngineConfig:
    """What every HTTP adapter is configured with (the vLLM and SGLang configs extend it)."""

    url: str
    """Base URL of the server, without `/v1` (e.g. http://127.0.0.1:8001)."""
    vocab_size: int | None = None
    """When set, prompt ids outside [0, vocab_size) are refused before they reach the server."""
    timeout: float = 600.0
    """Seconds one HTTP read may wait (a generation streams, so this bounds silence)."""
    version: int = 0
    """The policy version of the weights the server was started with (an export's, see
    `engines.policy`). A server that an earlier update labelled (`labelled_version`) reports its
    label instead: it no longer serves the weights it started with."""


NO_LABEL = object()
"""`RemoteEngine._weight_label` of a server that cannot say which weights it serves."""


def labelled_version(label: object, started: int) -> int:
    """The version a server serves: its weight-version label where an update through an adapter
    set one (an integer), else `started`. vLLM and SGLang label a server that no update reached
    "default"."""
    text = str(label)
    return int(text) if text.isdigit() else started


class ServerPaused(Exception):
    """The server refused a sub-request because it is paused (vLLM 0.33 answers 503)."""


@dataclass(eq=False, slots=True)
class _Live:
    request_id: str
    aborted: bool = False
    sub_id: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when its stream has given its last chunk (or failed) and let go of the server."""


class RemoteEngine(abc.ABC):
    """An `engines.base.Engine` whose tokens come from a server over HTTP.

    Subclasses say how to send one sub-request and how to pause, resume, reload and probe the
    server; this class keeps versions, the gate, and the resubmission of interrupted requests.
    """

    def __init__(
        self,
        url: str,
        *,
        max_model_len: int,
        version: int = 0,
        base_version: int | None = None,
        vocab_size: int | None = None,
        timeout: float = 600.0,
        http: EngineHTTP | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._base_version = version if base_version is None else base_version
        """The version of the weights the server starts with (what an unlabelled server serves:
        a restarted one)."""
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.http = http if http is not None else EngineHTTP(self.url, timeout=timeout)
        """The connection pool to the server (`connect` hands over the one it asked with)."""
        self._version = version
        self._gate = asyncio.Event()
        self._gate.set()
        self._paused = False  # by `pause()`, as opposed to during a weight update
        self._control = asyncio.Lock()  # one pause/resume/update at a time
        self._live: dict[str, _Live] = {}
        self._closed = False
        self._group: WeightGroup | None = None
        """The weight group this server joined (None: none, or a transfer broke it)."""
        self._mixed = False
        """A broadcast failed part-way: the server's weights are neither version. No request
        is sent to it until an update (of any version, this one's too) has loaded whole ones."""

    # -- what a server adapter provides -------------------------------------------------------

    @abc.abstractmethod
    def _submit(
        self, sub_id: str, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> AsyncIterator[Piece]:
        """Stream one sub-request. Raises `ServerPaused` (before any piece) when a paused server
        refuses it, `InvalidRequestError` for a 4xx, `EngineUnavailableError` when unreachable."""

    @abc.abstractmethod
    async def _abort_sub(self, sub_id: str) -> None:
        """Ask the server to finish sub-request `sub_id` now (it ends with finish `abort`)."""

    @abc.abstractmethod
    async def _pause_server(self) -> None:
        """Pause generation, finishing running requests with `abort` and their partial output."""

    @abc.abstractmethod
    async def _resume_server(self) -> None: ...

    @abc.abstractmethod
    async def _load_weights(self, update: WeightUpdate, version: int) -> None:
        """With the server paused: load `update` (a path or a state dict), drop cached
        prefixes, label it `version`."""

    @abc.abstractmethod
    async def _probe(self) -> tuple[bool, int, int, str]:
        """(healthy, running, waiting, detail) as the server reports them."""

    async def _weight_label(self) -> object:
        """The server's weight-version label as it reports it now (`labelled_version` reads
        it), or `NO_LABEL` where the server cannot say."""
        return NO_LABEL

    async def weight_group_ranks(self) -> int:
        """How many ranks of a weight group the server's workers take."""
        return 1

    def weight_group_intact(self) -> bool:
        return self._group is not None

    async def join_weight_group(self, group: WeightGroup, rank_offset: int = 1) -> None:
        ranks = await self.weight_group_ranks()
        if rank_offset + ranks > group.world_size:  # refused: the group stays
            raise WeightUpdateError(
                f"the weight group has {group.world_size} ranks, too few for the server's "
                f"{ranks} from rank {rank_offset} on: ask for the group's size again"
            )
        async with self._control:
            self._group = None
            try:
                async with asyncio.timeout(group.timeout_s):
                    await self._join_group(group, rank_offset)
            except (TimeoutError, EngineUnavailableError) as exc:
                raise WeightUpdateError(
                    f"{self.url} did not join the weight group {group.name} at "
                    f"{group.master_address}:{group.master_port} within {group.timeout_s:g} s: "
                    f"{str(exc) or 'timed out'}"
                ) from exc
            self._group = group

    async def _join_group(self, group: WeightGroup, rank_offset: int) -> None:
        raise WeightUpdateError(f"{type(self).__name__} cannot join a weight group")

    async def _receive(self, broadcast: Broadcast, group: WeightGroup, version: int) -> None:
        """With the server paused: receive `broadcast` bucket by bucket over `group` (its rank
        0 sends meanwhile), drop cached prefixes, label it `version`."""
        raise WeightUpdateError(f"{type(self).__name__} cannot receive weights over a group")

    async def _load_broadcast(self, broadcast: Broadcast, version: int) -> None:
        group = self._group
        if group is None:
            raise WeightUpdateError(
                f"{self.url} is in no weight group: join one first (POST /admin/weights/group)"
            )
        try:
            async with asyncio.timeout(group.timeout_s):
                await self._receive(broadcast, group, version)
        except (TimeoutError, EngineUnavailableError) as exc:
            self._group = None  # a broken transfer breaks the group: it must be formed again
            self._mixed = True
            raise WeightUpdateError(
                f"{self.url} did not receive the weights over {group.name} within "
                f"{group.timeout_s:g} s: {str(exc) or 'timed out'}"
            ) from exc
        except WeightUpdateError:
            self._group = None
            self._mixed = True
            raise

    # -- the Engine protocol ------------------------------------------------------------------

    def version(self) -> int:
        return self._version

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        request.validate()
        n_prompt = len(request.prompt_ids)
        asked = request.sampling.max_new_tokens
        if n_prompt >= self.max_model_len or (
            asked is not None and n_prompt + asked > self.max_model_len
        ):
            raise PromptTooLongError(n_prompt, asked or 0, self.max_model_len)
        if self.vocab_size is not None:
            for t in request.prompt_ids:
                if not 0 <= t < self.vocab_size:
                    raise TokenOutOfRangeError(t, self.vocab_size)
        if self._closed:
            raise EngineUnavailableError(f"the engine for {self.url} is closed")
        if self._mixed:
            raise EngineUnavailableError(
                f"{self.url} holds part of a weight broadcast that failed: it serves again once "
                "whole weights are loaded (the trainer publishes that version from disk)"
            )
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already live")
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        # Registered here, not in `generate`: a stream that is never iterated leaves nothing.
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already live")
        live = self._live[request.request_id] = _Live(request.request_id)
        sp = request.sampling
        budget = sp.max_new_tokens or self.max_model_len - len(request.prompt_ids)
        produced: list[int] = []
        try:
            while True:
                try:
                    await self._wait_gate()
                except EngineUnavailableError:  # closed: an aborted request still ends as one
                    if not live.aborted:
                        raise
                if live.aborted:
                    yield TokenChunk((), (), (), FinishReason.ABORT)
                    return
                version = self._version
                sub_sampling = replace(
                    sp,
                    max_new_tokens=budget - len(produced),
                    min_new_tokens=max(0, sp.min_new_tokens - len(produced)),
                )
                live.sub_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
                live.started = asyncio.Event()
                last: Piece | None = None
                try:
                    async for piece in self._submit(
                        live.sub_id, request.prompt_ids + tuple(produced), sub_sampling
                    ):
                        live.started.set()
                        if piece.finish is not None:
                            last = piece
                        elif piece.token_ids:
                            produced += piece.token_ids
                            yield _chunk(piece, version, None)
                except ServerPaused:
                    await asyncio.sleep(PAUSED_RETRY_S)
                    continue
                finally:
                    live.started.set()
                # The last piece goes out once the sub-request's response is over: a consumer
                # leaves at it, and leaving while the response is open would close its
                # connection instead of keeping it for the next request (EngineHTTP.stream).
                finish: FinishReason | None = None
                if last is not None:
                    produced += last.token_ids
                    finish = last.finish
                    if finish == FinishReason.ABORT and not live.aborted:
                        finish = None  # interrupted by a pause: resubmit the rest
                    if last.token_ids or finish is not None:
                        yield _chunk(last, version, finish)
                if finish is not None:
                    return
                if len(produced) >= budget:  # the server stopped at our budget without saying
                    yield TokenChunk((), (), (), FinishReason.LENGTH)
                    return
        finally:
            self._live.pop(request.request_id, None)
            live.ended.set()

    async def _wait_gate(self) -> None:
        while not self._gate.is_set():
            if self._closed:
                break
            await self._gate.wait()
        if self._closed:
            raise EngineUnavailableError(f"the engine for {self.url} is closed")

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        live.aborted = True
        if live.sub_id is not None:
            with contextlib.suppress(EngineUnavailableError):
                await self._abort_sub(live.sub_id)

    async def pause(self) -> None:
        async with self._control:
            if not self._paused:
                await self._interrupt()
                self._paused = True

    async def resume(self) -> None:
        async with self._control:
            if self._paused and not self._mixed:  # mixed weights: the next update resumes
                await self._resume_server()
                self._gate.set()
            self._paused = False

    async def update_weights(self, update: WeightUpdate) -> int:
        async with self._control:
            version = update.version if update.version is not None else self._version + 1
            # a server left on mixed weights by a failed broadcast takes its version again
            if version < self._version or (version == self._version and not self._mixed):
                raise WeightUpdateError(
                    f"version {version} is not newer than the current version {self._version}"
                )
            if not self._paused:
                await self._interrupt()
            try:
                if update.broadcast is not None:
                    await self._load_broadcast(update.broadcast, version)
                else:
                    await self._load_weights(update, version)
                self._version = version
                self._mixed = False
            finally:
                # on mixed weights the server stays paused and requests in flight wait for the
                # next update, so that no token comes from them
                if not self._paused and not self._mixed:
                    await self._resume_server()
                    self._gate.set()
            return version

    async def _interrupt(self) -> None:
        """Close the gate, let sub-requests on the wire reach the server, pause it (abort)."""
        self._gate.clear()
        pending = [live.started.wait() for live in self._live.values() if live.sub_id]
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STARTED_GRACE_S):
                    await asyncio.gather(*pending)
        try:
            await self._pause_server()
        except BaseException:
            self._gate.set()
            raise

    async def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(
                ok=False, paused=False, version=self._version, running=0, waiting=0,
                detail=f"the engine for {self.url} is closed",
            )  # fmt: skip
        try:
            ok, running, waiting, detail = await self._probe()
        except EngineUnavailableError as exc:
            ok, running, waiting, detail = False, 0, 0, str(exc)
        if ok:
            await self._adopt_served_version()
        return EngineHealth(
            ok=ok and not self._closed,
            paused=not self._gate.is_set(),
            version=self._version,
            running=running,
            waiting=waiting,
            detail=detail,
        )

    async def _adopt_served_version(self) -> None:
        """Believe the server about the version it serves: one restarted on its own weights
        (unlabelled) or updated by someone else no longer serves what this adapter last loaded,
        and every token it samples must carry the version it really has. Skipped while an update
        of ours runs or lands meanwhile (its label is in flux)."""
        if self._control.locked():
            return
        before = self._version
        try:
            label = await self._weight_label()
        except (EngineUnavailableError, ValueError):  # unreachable, or not JSON: no answer
            return
        if label is NO_LABEL or self._control.locked() or self._version != before:
            return
        served = labelled_version(label, self._base_version)
        if served != before:
            log.warning(
                "%s serves policy version %d, not %d (restarted, or updated by someone else)",
                self.url,
                served,
                before,
            )
            self._version = served

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        live = list(self._live.values())
        for each in live:  # before waking the waiters: each ends as aborted, not as an error
            each.aborted = True
        self._gate.set()  # wake waiters, who then see `_closed`
        await asyncio.gather(
            *(self._abort_sub(each.sub_id) for each in live if each.sub_id),
            return_exceptions=True,
        )
        # Their streams take the server's last piece and end, then the connections close: closed
        # under a stream, the pool would end it with an error instead of its aborted finish.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_S):
                await asyncio.gather(*(e.ended.wait() for e in live))
        await self.http.close()

    @property
    def live_requests(self) -> int:
        return len(self._live)


def _chunk(piece: Piece, version: int, finish: FinishReason | None) -> TokenChunk:
    """`piece` as the Engine protocol's chunk, every token stamped with `version`."""
    n = len(piece.token_ids)
    return TokenChunk(piece.token_ids, piece.logprobs, (version,) * n, finish, piece.top_logprobs)
