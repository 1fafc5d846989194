"""Property-based: every tool-call parser reads back whatever calls its format writes (names,
nested JSON values, several calls)."""

from __future__ import annotations

import json
import keyword
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.tool_parsers import Llama3JsonParser, Llama4PythonicParser
from tests.support.tool_formats import FORMATS, Call, calls_of, llama3, pythonic

# Strings without `<` or `[`: a value holding the format's own closing tag is a known limit of
# every text format here, not what these properties are about.
_TEXT = st.text(st.characters(exclude_characters="<[", exclude_categories=["Cs"]), max_size=12)
_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


def _reads_as_json(s: str) -> bool:
    try:
        json.loads(s.strip())
    except ValueError:
        return False
    return True


# Qwen3-Coder writes strings bare, so a string that reads as JSON ("42") is not one it can carry.
_QWEN3_VALUE = _JSON.filter(lambda v: not (isinstance(v, str) and _reads_as_json(v)))


def _calls_of(
    keys: st.SearchStrategy[str], values: st.SearchStrategy[Any]
) -> st.SearchStrategy[list[Call]]:
    args = st.dictionaries(keys, values, max_size=4)
    return st.lists(st.tuples(_NAME, args), min_size=1, max_size=3)


def _round_trips(fmt: str, calls: list[Call]) -> None:
    parser, write = FORMATS[fmt]
    parsed = parser.parse(write(calls))
    assert parsed[0] is None
    assert calls_of(parsed) == calls


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_TEXT, _JSON))
def test_hermes_reads_back_what_it_writes(calls: list[Call]) -> None:
    _round_trips("hermes", calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_NAME, _QWEN3_VALUE))
def test_qwen3_coder_reads_back_what_it_writes(calls: list[Call]) -> None:
    _round_trips("qwen3_coder", calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_TEXT, _JSON), tag=st.booleans())
def test_llama3_json_reads_back_what_it_writes(calls: list[Call], tag: bool) -> None:
    parsed = Llama3JsonParser().parse(("<|python_tag|>" if tag else "") + llama3(calls))
    assert parsed[0] is None
    assert calls_of(parsed) == calls


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_TEXT, _JSON), fmt=st.sampled_from(["mistral_v3", "mistral_v11"]))
def test_mistral_reads_back_what_it_writes(calls: list[Call], fmt: str) -> None:
    _round_trips(fmt, calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_NAME, _QWEN3_VALUE))
def test_glm45_reads_back_what_it_writes(calls: list[Call]) -> None:
    _round_trips("glm45", calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_NAME, _QWEN3_VALUE))
def test_minimax_m2_reads_back_what_it_writes(calls: list[Call]) -> None:
    _round_trips("minimax_m2", calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_TEXT, _JSON), fmt=st.sampled_from(["granite", "phi4_mini_json"]))
def test_the_json_list_formats_read_back_what_they_write(calls: list[Call], fmt: str) -> None:
    _round_trips(fmt, calls)


@settings(max_examples=50, deadline=None, database=None)
@given(calls=_calls_of(_NAME, _JSON))
def test_harmony_reads_back_what_it_writes(calls: list[Call]) -> None:
    _round_trips("openai", calls)


_IDENTIFIER = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)


@settings(max_examples=50, deadline=None, database=None)
@given(
    calls=st.lists(
        st.tuples(_IDENTIFIER, st.dictionaries(_IDENTIFIER, _JSON, max_size=4)),
        min_size=1,
        max_size=3,
    ),
    wrapped=st.booleans(),
)
def test_llama4_pythonic_reads_back_what_it_writes(calls: list[Call], wrapped: bool) -> None:
    text = pythonic(calls)
    if wrapped:
        text = f"<|python_start|>{text}<|python_end|>"
    parsed = Llama4PythonicParser().parse(text)
    assert parsed[0] is None
    assert calls_of(parsed) == calls
