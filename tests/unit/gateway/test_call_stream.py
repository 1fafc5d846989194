"""A forced call's arguments read as they are sampled (`gateway.core.call_stream`): the JSON object
from its first brace, as far as it is written, whole once its own closing brace is; braces and
quotes inside strings are the string's. A stream reads them with a `CallScanner`, which keeps its
place between chunks and must read what the whole reading reads."""

from __future__ import annotations

import json

import pytest

from gateway.core.call_stream import CallScanner, arguments_so_far, first_call_so_far

WHOLE = '{"code": "if (x) { return \\"}\\"; }", "n": {"k": [1, {"j": 2}]}}'


@pytest.mark.parametrize("cut", range(len(WHOLE) + 1))
def test_every_prefix_reads_as_far_as_it_is_written(cut: int) -> None:
    text, whole = arguments_so_far(WHOLE[:cut])
    assert text == WHOLE[WHOLE.find("{") : cut] if cut else text == ""
    assert whole is (cut == len(WHOLE))


def test_the_closing_markup_after_the_object_is_not_part_of_it() -> None:
    text, whole = arguments_so_far(WHOLE + "}\n</tool_call>")
    assert (json.loads(text), whole) == (json.loads(WHOLE), True)


def test_text_before_the_object_is_not_part_of_it() -> None:
    assert arguments_so_far("12<|tool_call_argument_begin|>" + WHOLE) == (WHOLE, True)
    assert arguments_so_far("no object yet") == ("", False)


PREFILL = '<tool_call>\n{"name": "NAME", "arguments": '
NAMES = ["add", "add_all", "write"]


def prefill(name: str) -> str:
    return PREFILL.replace("NAME", name)


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_a_scanner_fed_a_growing_reply_reads_what_the_whole_reading_reads(step: int) -> None:
    """Chunk by chunk (of `step` characters), the scanner that keeps its place answers as
    `first_call_so_far` of the text so far, through the name, the object and what follows."""
    reply = prefill("write") + WHOLE + "}\n</tool_call>"
    scanner = CallScanner(NAMES, prefill)
    for cut in [*range(0, len(reply), step), len(reply)]:
        assert scanner.scan(reply[:cut]) == first_call_so_far(reply[:cut], NAMES, prefill)
    assert scanner.scan(reply) == ("write", WHOLE)


def test_a_text_that_does_not_extend_the_last_one_is_read_again() -> None:
    scanner = CallScanner(NAMES, prefill)
    assert scanner.scan(prefill("add") + '{"a": 1') == ("add", '{"a": 1')
    other = prefill("add_all") + '{"b": {"c": 2}}'
    assert scanner.scan(other) == ("add_all", '{"b": {"c": 2}}')
    assert scanner.scan("plain text") is None
