"""What the OpenAI-family protocols (chat completions and the Responses API) share on the wire:
a sampled token's logprob entry with its alternatives."""

from __future__ import annotations

from typing import Any

from gateway.core.choices import TokenPieces


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
