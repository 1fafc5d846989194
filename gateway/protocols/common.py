"""What the OpenAI-family protocols (chat completions and the Responses API) share on the wire:
a sampled token's logprob entry with its alternatives, and their routes' error envelope."""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute

from gateway.core.choices import TokenPieces
from gateway.errors import INVALID_AS_400, ErrorEnvelope


def chat_logprobs(
    pieces: TokenPieces,
    ids: list[int],
    logprobs: list[float],
    tops: list[tuple[tuple[int, float], ...]],
) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries for sampled tokens."""
    out = []
    for i, (tok, lp) in enumerate(zip(ids, logprobs, strict=True)):
        text, raw = pieces(tok)
        alternatives = []
        for alt, alt_lp in tops[i] if i < len(tops) else ():
            alt_text, alt_raw = pieces(alt)
            alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return out


class OpenAIRoute(APIRoute):
    """A route of the OpenAI protocols (chat, completions, models, Responses): errors in OpenAI's
    shape with OpenAI's statuses, a field's invalid value a 400 (`gateway.errors.envelope_of`
    reads it)."""

    error_envelope: ErrorEnvelope = INVALID_AS_400
