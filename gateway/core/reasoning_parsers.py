"""Reasoning parsers: where a reply's reasoning ends and its answer begins.

Qwen3 and DeepSeek-R1 style models write `<think>...</think>` before the answer; a template may
open the block itself in the generation prompt (DeepSeek-R1 ends it with `<think>\\n`), so the
reply holds only the closing tag. The reasoning is never cut out of the recorded tokens (they are
what was sampled); it is only split off the reply's text, which the protocols hand out as
`reasoning_content` (chat completions), `reasoning` items (Responses) and `thinking` blocks
(Messages). Chosen from the chat template (`detect_reasoning_parser`), or by the setting
`reasoning_parser`. gpt-oss writes its reasoning as harmony analysis messages
(`openai_gptoss`, `gateway.core.harmony`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core import harmony


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str | None
    """The reasoning text (None: the reply has none)."""
    answer: str
    """The rest of the reply, from which tool calls are parsed."""
    done: bool
    """The reasoning has ended (or there is none): `answer` may be shown."""


class ReasoningParser(Protocol):
    name: str
    markers: tuple[str, ...]
    """Texts a streamed reply holds back until they are decided (partial tags)."""

    def opens(self, prompt_text: str) -> bool:
        """The prompt (its rendered tail) opens a reasoning block the reply continues."""
        ...

    def split(self, text: str, *, opened: bool) -> Split: ...


class ThinkParser:
    """`<think>reasoning</think>answer`, the reasoning and the answer stripped of the blank
    lines around them."""

    name: str = "think"
    start, end = "<think>", "</think>"
    markers: tuple[str, ...] = (start, end)

    def opens(self, prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(self.start)

    def split(self, text: str, *, opened: bool) -> Split:
        body = text.lstrip()
        started = opened or body.startswith(self.start)
        if not started:
            return Split(None, text, True)
        if body.startswith(self.start):
            body = body[len(self.start) :]
        at = body.find(self.end)
        if at < 0:
            return Split(body.strip(), "", False)
        return Split(body[:at].strip(), body[at + len(self.end) :].lstrip(), True)


class HarmonyParser:
    """gpt-oss's harmony messages (vLLM's `openai_gptoss`): the analysis channel's bodies are the
    reasoning; the answer is every other message, a message to the user as its body, a call to a
    function as the call (`harmony.Message.canonical`, which the `openai` tool parser reads). The
    reasoning has ended once a message on another channel has its header written."""

    name: str = "openai_gptoss"
    markers: tuple[str, ...] = harmony.MARKUP

    def opens(self, prompt_text: str) -> bool:
        return False  # the generation prompt opens a message, never its channel

    def split(self, text: str, *, opened: bool) -> Split:
        reply = harmony.read(text)
        analysis = [m.body for m in reply.messages if m.channel == "analysis"]
        rest = [m for m in reply.messages if m.channel != "analysis"]
        answer = "".join(m.body if m.recipient is None else m.canonical() for m in rest)
        if not analysis:
            return Split(None, answer, not reply.pending)
        return Split("\n".join(analysis), answer, bool(rest))


REASONING_PARSERS: dict[str, type[ThinkParser] | type[HarmonyParser]] = {
    "think": ThinkParser,
    "openai_gptoss": HarmonyParser,
}


def detect_reasoning_parser(chat_template: str) -> str:
    """`openai_gptoss` for a harmony template (gpt-oss's analysis channel), `think` for one that
    writes `<think>` (Qwen3, DeepSeek-R1), else `none`."""
    if harmony.CHANNEL + "analysis" in chat_template:
        return "openai_gptoss"
    return "think" if ThinkParser.start in chat_template else "none"


def build_reasoning_parser(name: str, chat_template: str) -> ReasoningParser | None:
    """`name` "auto": detected from the template; "none": no parser; else the registry's."""
    if name == "auto":
        name = detect_reasoning_parser(chat_template)
    if name == "none":
        return None
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        known = ", ".join(["auto", "none", *REASONING_PARSERS])
        raise ValueError(f"unknown reasoning parser {name!r}: use one of {known}")
    return cls()


SEAL = "rlg1."
"""The prefix of the gateway's own `encrypted_content`."""


def seal_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: opaque to the client, the reasoning text exactly to
    the gateway (the item's visible text is whatever the client chooses to send back)."""
    return SEAL + base64.urlsafe_b64encode(text.encode()).decode()


def unseal_reasoning(sealed: Any) -> str | None:
    """The reasoning text of an `encrypted_content` the gateway sealed, else None."""
    if not isinstance(sealed, str) or not sealed.startswith(SEAL):
        return None
    try:
        return base64.urlsafe_b64decode(sealed.removeprefix(SEAL)).decode()
    except (ValueError, UnicodeDecodeError):
        return None
