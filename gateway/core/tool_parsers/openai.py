"""openai (gpt-oss, OpenAI's harmony format, `gateway.core.harmony`): a call is a message on the
commentary channel to the recipient `functions.NAME`, its body the JSON arguments, ended by
`<|call|>`, which ends the reply: one call a reply. Messages to the user (the final answer, a
commentary preamble) are the content; analysis messages are reasoning, which the reasoning parser
`openai_gptoss` takes out first (without it they are left out of the content of a reply with a
call)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core import harmony
from gateway.core import tool_grammars as tg
from gateway.core.tool_grammars import Marks, literal
from gateway.core.tool_parsers.base import (
    CallIds,
    Parsed,
    ParsedToolCall,
    first_marker,
    is_name,
    json_object,
    with_calls,
)

RECIPIENT = " to=" + harmony.FUNCTIONS
"""A header naming a function first (` to=functions.NAME<|channel|>commentary json`), as the
template writes calls back and the model may write its first message."""
BODY = f" {harmony.CONSTRAIN}json{harmony.MESSAGE}"
"""Between a call's name and its arguments."""


class OpenAIParser:
    """Every message to a function tool is a call (arguments a JSON object, a bare name, else the
    reply is text); a recipient outside `functions.` (gpt-oss's built-in browser and python
    tools, which a request never declares) makes the reply text."""

    name = "openai"
    call_ids: CallIds = "call"
    json_arguments = True
    markers: tuple[str, ...] = (harmony.START, harmony.CHANNEL, RECIPIENT)
    call_end: str | None = harmony.CALL
    markup: tuple[str, ...] = harmony.MARKUP

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> Parsed:
        if first_marker(text, self.markers) < 0 and not text.startswith(RECIPIENT.lstrip()):
            return text, []
        reply = harmony.read(text)
        sent = [m for m in reply.messages if m.recipient is not None]
        if not sent:
            return text, []
        calls = []
        for message in sent:
            name, args = message.function, json_object(message.body)
            if name is None or not is_name(name) or args is None:
                return text, []
            calls.append(ParsedToolCall(name, json.dumps(args)))
        said = [m.body for m in reply.messages if m.recipient is None and m.channel != "analysis"]
        return with_calls("\n".join(said), calls)

    def prefill(self, name: str | None) -> str:
        opened = f"{harmony.CHANNEL}commentary{RECIPIENT}"
        return opened if name is None else opened + name + BODY

    def grammar(
        self, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool, marks: Marks
    ) -> str:
        """One call whatever `parallel` says: `<|call|>` ends the reply."""
        end = literal(harmony.CALL, marks)
        if name is not None:
            return tg.grammar(f"args {end}", tg.named(tools, name))
        call = tg.any_call(tools, "{name}" + BODY, harmony.CALL, marks)
        return tg.grammar("call", [call, *tg.arguments_rules(tools)])
