"""An engine that replays a fixed reply: for tests and benchmarks of the gateway's own work, where
what the model would say must be exactly known (two tool calls, a malformed one) or cost
nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

from engines.base import EngineHealth, FinishReason, GenerateRequest, TokenChunk, WeightUpdate


class ReplayEngine:
    """An engine that answers every request with the same token ids at once (`reply`, cut at the
    request's `max_new_tokens`), in chunks of the request's `stream_interval`; a consumer that
    stops reading (a stop string) ends it."""

    def __init__(self, reply: list[int], eos: int) -> None:
        self.reply = reply
        self.eos_token_ids = frozenset({eos})

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        ids = self.reply[: request.sampling.max_new_tokens or len(self.reply)]
        step = max(1, request.stream_interval)
        for at in range(0, len(ids), step):
            part = tuple(ids[at : at + step])
            finish = None
            if at + step >= len(ids):
                whole = len(ids) == len(self.reply)
                finish = FinishReason.STOP if whole else FinishReason.LENGTH
            yield TokenChunk(part, (-0.5,) * len(part), (0,) * len(part), finish)

    async def abort(self, request_id: str) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...

    async def update_weights(self, update: WeightUpdate) -> int:
        return 0

    def version(self) -> int:
        return 0

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, paused=False, version=0, running=0, waiting=0)

    async def close(self) -> None: ...
