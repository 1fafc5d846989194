"""Images, documents, files and audio in a request's messages: the model behind the gateway reads
text only, so a run says what becomes of them (`store.run_config.RunConfig.media`).

- `refuse` (the default): a 400 that names the part, so that nothing the agent sent is silently
  dropped from what the model saw and what is trained.
- `placeholder`: the part is rendered as a line of text, `[image omitted]`, recorded as context
  like any other prompt token; the agent (Claude Code having read a PNG, Codex viewing a
  screenshot) can go on in its session, and a later turn that sends the same history renders it
  the same way, so the segment continues token for token.
"""

from __future__ import annotations

from typing import Literal

from gateway.errors import BadRequest
from store.run_config import RunConfig

Media = Literal["refuse", "placeholder"]

KINDS = {
    "image": "image",
    "image_url": "image",
    "input_image": "image",
    "document": "document",
    "file": "file",
    "input_file": "file",
    "input_audio": "audio",
}
"""Each protocol's media part types (chat, Responses, Anthropic), and what their placeholder
says."""


def media_text(kind: str | None, where: str, media: Media) -> str | None:
    """The placeholder text of a media part of type `kind` at `where`, or None when `kind` is not
    media; under `refuse` a media part is the 400 that names it."""
    what = KINDS.get(kind or "")
    if what is None:
        return None
    if media == "placeholder":
        return f"[{what} omitted]"
    raise BadRequest(
        f"{where}: the model reads text only, and this run refuses {kind} parts; send text, or "
        "create the run with media: placeholder to have each such part rendered as "
        f"'[{what} omitted]' and the session go on",
        param=where,
    )


def media_of(run: RunConfig | None) -> Media:
    """The run's choice; an unrecorded call (the admin's, no run) refuses."""
    return "refuse" if run is None else run.media
