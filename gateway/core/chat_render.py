"""Messages to token ids and back: the gateway owns tokenization (docs/architecture.md,
"Contracts": token truth).

- `Message` is the neutral message: a plain dict that is rendered and compared (tool-call
  arguments parsed to objects, ids dropped, content flattened to text, an assistant's reasoning
  as `reasoning_content`), so that an agent echoing back our reply with different JSON spacing or
  fresh tool-call ids still extends its segment. Every protocol's adapter produces these same
  dicts from its own messages (chat's: `gateway.protocols.openai.chat.normalize_messages`).
- `ChatRenderer` renders with the model's chat template and computes the tokens that continue a
  segment: its exact tokens, then the template's end-of-turn glue, then the rendered new messages.
  The model's own output is never re-tokenized.
- Tool calls are read out of generated text by the model family's parser
  (`gateway.core.tool_parsers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from gateway.errors import BadRequest

Message = dict[str, Any]

_SENTINEL = "\x00rlgateway-sentinel\x00"
TAIL_CHARS = 8
"""How many of a reply's last characters the rendering of its turn must end with when the
template ends that turn otherwise than its answers (`ChatRenderer._glue`)."""


@dataclass(frozen=True, slots=True)
class Tools:
    callable: list[dict[str, Any]]
    """As chat tools: `{"type": "function", "function": {"name", "description", "parameters"}}`."""
    left_out: list[str]
    """The kinds (or names) of the tools the model cannot call."""


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A callable tool as the chat template gets it (`strict` and the like never change the
    prompt)."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


class ChatRenderer:
    """The model's chat template and tokenizer, and the glue between turns."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: chat needs one")
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.reasoning_key = _reasoning_key(str(tokenizer.chat_template))
        """The key an assistant message's reasoning goes to the template under:
        `reasoning_content` (Qwen3, GLM, DeepSeek), or `thinking` for a template that reads that
        one only (gpt-oss's)."""
        self.arguments_as_text = False
        """The template takes a call's arguments as JSON text (DeepSeek-V3.1's adds them to a
        string), not as the object most templates serialise: learned from the first render that
        fails with objects and succeeds with text."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = self.render(probe, None, add_generation_prompt=False)
        self.assistant_tail = rendered[rendered.index(_SENTINEL) + len(_SENTINEL) :]
        """What the template writes after an assistant message's content (ChatML: im_end, \\n)."""

    def render(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text. A template that refuses the messages (Mistral's and Gemma's raise
        on a system message after the first, for one) or fails on them (DeepSeek-V3.1's adds a
        call's arguments to a string, so arguments as an object are a TypeError) is the client's
        400 with the template's own words, not a 500 that SDKs retry."""

        if self.reasoning_key != "reasoning_content":
            messages = [_reasoning_as(m, self.reasoning_key) for m in messages]

        def apply(msgs: list[Message]) -> Any:
            return self.tokenizer.apply_chat_template(
                msgs,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )

        try:
            if self.arguments_as_text:
                text = apply(_arguments_as_text(messages))
            else:
                try:
                    text = apply(messages)
                except TypeError:
                    if messages == (as_text := _arguments_as_text(messages)):
                        raise
                    text = apply(as_text)
                    self.arguments_as_text = True
        except TemplateError as exc:
            raise BadRequest(
                f"the model's chat template refused these messages: {exc}", param="messages"
            ) from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            raise BadRequest(
                f"the model's chat template failed on these messages ({type(exc).__name__}: {exc})",
                param="messages",
            ) from exc
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def prompt(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        prefill: str = "",
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a fresh prompt: the rendered messages and the generation prompt."""
        text = self.render(
            messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs
        )
        return self.encode(text + prefill)

    def continuation(
        self,
        segment_tokens: list[int],
        transcript: list[Message],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        prefill: str = "",
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int] | None:
        """The prompt that continues a segment whose transcript `messages` extends: the segment's
        exact tokens, the end-of-turn glue, and the new messages rendered. None when the new
        messages' rendering cannot be told apart (the caller then opens a new segment).

        The new messages are what the template writes after the segment's last turn. Where it is
        append-only, that is the full rendering past the transcript's own. Where it re-renders
        earlier turns once more messages follow (Qwen3 drops the reasoning of turns before the
        last user message), it is what follows the end of that last turn in the full rendering;
        the segment keeps its exact tokens either way, as they were sampled."""
        glue, before = self._glue(segment_tokens, transcript, tools, template_kwargs or {})
        if glue is None:
            return None
        suffix = self._new_suffix(before, transcript, messages, tools, template_kwargs or {})
        if suffix is None:
            return None
        return segment_tokens + self.encode(glue + suffix + prefill)

    def _glue(
        self,
        segment_tokens: list[int],
        transcript: list[Message],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> tuple[str | None, str]:
        """(What follows the segment's last sampled token before the new messages, or None when
        the template's rendering of the last turn does not end as the turn did; that rendering).

        Most templates end every assistant turn with `assistant_tail` (ChatML's im_end and a
        newline), whose start is the end-of-sequence token the model stopped on. Some end a turn
        that calls a tool otherwise (harmony: `<|call|>`, where an answer ends `<|return|>`); the
        model then wrote that end itself, and the glue is nothing when the template's rendering
        ends with the reply's own last `TAIL_CHARS` characters (with or without its final
        end-of-sequence token)."""
        before = self.render(transcript, tools, add_generation_prompt=False, template_kwargs=kwargs)
        stopped = bool(segment_tokens) and segment_tokens[-1] in self.eos_token_ids
        if before.endswith(self.assistant_tail):
            glue = self.assistant_tail
            if stopped:
                eos_text = self.decode(segment_tokens[-1:], skip_special_tokens=False)
                if glue.startswith(eos_text):
                    glue = glue[len(eos_text) :]
            return glue, before
        for ids in (segment_tokens, segment_tokens[:-1] if stopped else []):
            tail = self.decode(ids[-TAIL_CHARS:], skip_special_tokens=False)[-TAIL_CHARS:]
            if len(tail) == TAIL_CHARS and before.endswith(tail):
                return "", before
        return None, before

    def _new_suffix(
        self,
        before: str,
        transcript: list[Message],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> str | None:
        """The rendering of `messages[len(transcript):]` and the generation prompt, as the
        template writes them after the transcript's last turn (an assistant reply), whose
        rendering is `before`."""
        full = self.render(messages, tools, add_generation_prompt=True, template_kwargs=kwargs)
        if full.startswith(before):
            return full[len(before) :]
        # Not append-only: find where the last turn ends in the full rendering, by its content
        # replaced with a sentinel (the turn's own text may appear earlier too).
        k = len(transcript) - 1
        if not 0 <= k < len(messages) or messages[k].get("role") != "assistant":
            return None
        marked = [*messages[:k], {**messages[k], "content": _SENTINEL}, *messages[k + 1 :]]
        marked[k].pop("reasoning_content", None)
        text = self.render(marked, tools, add_generation_prompt=True, template_kwargs=kwargs)
        at = text.find(_SENTINEL)
        end = -1 if at < 0 else text.find(self.assistant_tail, at + len(_SENTINEL))
        if end < 0 or text.count(_SENTINEL) != 1:
            return None
        return text[end + len(self.assistant_tail) :]


def _reasoning_key(template: str) -> str:
    reads_thinking = "message.thinking" in template or "message['thinking']" in template
    return (
        "thinking"
        if reads_thinking and "reasoning_content" not in template
        else ("reasoning_content")
    )


def _reasoning_as(message: Message, key: str) -> Message:
    if "reasoning_content" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    out[key] = message["reasoning_content"]
    return out


def _arguments_as_text(messages: list[Message]) -> list[Message]:
    """`messages` with every call's arguments as JSON text (as the client sent them, but for
    spacing: `json.dumps`'s, which is how such templates' models write them)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = m | {
                "tool_calls": [
                    c
                    | {
                        "function": c["function"]
                        | {"arguments": _text(c["function"].get("arguments", {}))}
                    }
                    for c in calls
                ]
            }
        out.append(m)
    return out


def _text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
