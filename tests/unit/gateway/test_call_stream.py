"""A forced call's arguments read as they are sampled (`gateway.core.call_stream`): the JSON object
from its first brace, as far as it is written, whole once its own closing brace is; braces and
quotes inside strings are the string's."""

from __future__ import annotations

import json

import pytest

from gateway.core.call_stream import arguments_so_far

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
