"""OpenAI's harmony format (gpt-oss), read as text: a reply is a sequence of messages, each a
header, `<|message|>`, a body and an end marker.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.F <|constrain|>json<|message|>{}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The template's generation prompt is `<|start|>assistant`, so the reply's first message has no
`<|start|>`; each later one has. A header names the channel (`analysis`: reasoning; `final`: the
answer; `commentary`: a tool call when it has a recipient `to=functions.NAME`, else a preamble the
user may see), may name the recipient before or after the channel, and may name the body's type
(`<|constrain|>json`, or the bare `json` the template writes). `<|call|>` and `<|return|>` end the
reply (gpt-oss stops on them), `<|end|>` ends one message. Text that opens with no header (a model
that ignores the format) is one plain message. Pure functions: the reasoning parser
(`reasoning_parsers.HarmonyParser`) and the tool-call parser (`tool_parsers.openai`) both read
replies with `read`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
ENDS = (END, CALL, RETURN)
MARKUP = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
"""Every tag of the format (each one special token in gpt-oss's tokenizer)."""
FUNCTIONS = "functions."
"""The namespace of a request's function tools in a recipient."""

_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s)to=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Message:
    channel: str | None
    """`analysis`, `commentary`, `final`; None: plain text outside the format."""
    recipient: str | None
    """`functions.NAME` for a tool call; None: to the user."""
    body: str
    ended: bool
    """Its end marker was written (a reply cut by its token limit ends unended)."""

    @property
    def function(self) -> str | None:
        """The function tool this message calls, if it calls one."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]

    def canonical(self) -> str:
        """The message written back as the model writes a call (what a tool-call parser reads
        after the reasoning parser took the analysis out)."""
        to = f" to={self.recipient}" if self.recipient else ""
        kind = f" {CONSTRAIN}json" if self.recipient else ""
        end = CALL if self.recipient else END
        return f"{CHANNEL}{self.channel or 'commentary'}{to}{kind}{MESSAGE}{self.body}" + (
            end if self.ended else ""
        )


@dataclass(frozen=True, slots=True)
class Reply:
    messages: tuple[Message, ...]
    """Every message whose header is complete (the last one's body may still grow)."""
    pending: bool
    """The text ends inside a header not yet closed by `<|message|>` (a stream in flight)."""


def read(text: str) -> Reply:
    """The messages of a reply (or any tail of one that starts at a message)."""
    messages: list[Message] = []
    pos = 0
    if not _opens_header(text, 0):
        plain_end = _next_start(text, 0)
        messages.append(Message(None, None, text[:plain_end], plain_end < len(text)))
        pos = plain_end
    while pos < len(text):
        if text.startswith(START, pos):
            pos += len(START)
        open_at = text.find(MESSAGE, pos)
        if open_at < 0:
            return Reply(tuple(messages), True)
        header = text[pos:open_at]
        body_at = open_at + len(MESSAGE)
        end_at, marker = _first_end(text, body_at)
        messages.append(_message(header, text[body_at:end_at], marker is not None))
        pos = end_at + (len(marker) if marker else 0)
    return Reply(tuple(messages), False)


def _opens_header(text: str, at: int) -> bool:
    rest = text[at:]
    return rest.startswith((START, CHANNEL)) or rest.lstrip(" ").startswith("to=") or rest == ""


def _next_start(text: str, at: int) -> int:
    found = [i for i in (text.find(START, at), text.find(CHANNEL, at)) if i >= 0]
    return min(found, default=len(text))


def _first_end(text: str, at: int) -> tuple[int, str | None]:
    hits = [(i, m) for m in ENDS if (i := text.find(m, at)) >= 0]
    if not hits:
        return len(text), None
    return min(hits)


def _message(header: str, body: str, ended: bool) -> Message:
    role_free = header.removeprefix("assistant")
    channel = _CHANNEL_RE.search(role_free)
    recipient = _RECIPIENT_RE.search(role_free.replace(CHANNEL, " "))
    return Message(
        channel.group(1) if channel else None,
        recipient.group(1) if recipient else None,
        body,
        ended,
    )
