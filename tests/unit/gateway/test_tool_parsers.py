"""Tool-call parsers per model family: each reads back the calls its format writes, keeps
malformed calls and marker-free text as content, and parses its own forced prefill; `hermes` is
the gateway's earlier Hermes parsing exactly; the template picks the parser."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.core.tool_parsers import (
    TOOL_PARSERS,
    DeepseekV31Parser,
    Glm45Parser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    Llama4PythonicParser,
    MinimaxM2Parser,
    MistralParser,
    NoToolParser,
    ParsedToolCall,
    Phi4MiniJsonParser,
    Qwen3CoderParser,
    ToolCallParser,
    build_tool_parser,
    detect_tool_parser,
)
from gateway.core.tool_parsers import deepseek_v31 as DS
from tests.support.paths import REPO_ROOT
from tests.support.tool_formats import FORMATS, Call, hermes, llama3, qwen3

ROOT = REPO_ROOT


FORMAT_IDS = list(FORMATS)
WITH_CONTENT = [f for f in FORMAT_IDS if f != "llama3_json"]

WEATHER: Call = ("get_weather", {"city": "Paris", "days": 3, "units": None})
SEARCH: Call = ("web.search", {"query": "tool calls", "filters": {"site": ["a.org"], "n": 2.5}})


def _calls(parsed: tuple[str | None, list[ParsedToolCall]]) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


@pytest.mark.parametrize("fmt", FORMAT_IDS)
def test_one_call_is_read_with_its_arguments(fmt: str) -> None:
    parser, write = FORMATS[fmt]
    parsed = parser.parse(write([WEATHER]))
    assert parsed[0] is None
    assert _calls(parsed) == [WEATHER]


@pytest.mark.parametrize("fmt", FORMAT_IDS)
def test_two_calls_are_read_in_order(fmt: str) -> None:
    parser, write = FORMATS[fmt]
    parsed = parser.parse(write([WEATHER, SEARCH]))
    assert parsed[0] is None
    assert _calls(parsed) == [WEATHER, SEARCH]


@pytest.mark.parametrize("fmt", WITH_CONTENT)
def test_text_before_a_call_is_the_content_stripped(fmt: str) -> None:
    parser, write = FORMATS[fmt]
    parsed = parser.parse("  Let me check the weather.\n\n" + write([WEATHER]))
    assert parsed[0] == "Let me check the weather."
    assert _calls(parsed) == [WEATHER]


def test_llama3_json_with_text_before_it_is_all_content() -> None:
    text = "Let me check. " + llama3([WEATHER])
    assert Llama3JsonParser().parse(text) == (text, [])


@pytest.mark.parametrize("fmt", FORMAT_IDS)
@pytest.mark.parametrize(
    "text",
    ["", "The answer is 42.", "Code: {'name': 1} [1, 2] <b>bold</b> {\"x\": 1}", "  padded \n"],
)
def test_text_without_a_marker_is_all_content_unchanged(fmt: str, text: str) -> None:
    parser, _ = FORMATS[fmt]
    assert parser.parse(text) == (text, [])


MALFORMED: dict[str, list[str]] = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        'Sure. <tool_call>\n["f", {}]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\nnot json',
    ],
    "qwen3_coder": [
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function={{ tool_call.name }}>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
        "Ok.\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n<tool_call>\noops</tool_call>",
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": 1}',
        '{"name": "f", "parameters": {}} and then some words',
        '{"name": 3, "parameters": {}}',
        '{"name": "f", "parameters": {}};',
        '{"name": "f", "parameters": {}},{"name": "g", "parameters": {}}',
        '<|python_tag|>brave_search.call(query="weather")',
    ],
    "llama4_pythonic": [
        "[get_weather('Paris')]",
        "[get_weather(city=Paris)]",
        "[web.search(q='x')]",
        "[f(a=1)] and then words",
        "Sure. [f(a=1)]",
        "[f(a=true)]",
        "[]",
        "[f(a={1, 2})]",
    ],
    "deepseek_v31": [
        DS.CALLS_BEGIN + DS.CALL_BEGIN + "f" + DS.SEP + '{"a": 1' + DS.CALL_END + DS.CALLS_END,
        DS.CALLS_BEGIN + DS.CALL_BEGIN + "f" + DS.SEP + "[1]" + DS.CALL_END + DS.CALLS_END,
        DS.CALLS_BEGIN + "stray" + DS.CALL_BEGIN + "f" + DS.SEP + "{}" + DS.CALL_END,
        DS.CALLS_BEGIN + DS.CALL_BEGIN + "two words" + DS.SEP + "{}" + DS.CALL_END,
        "Sure." + DS.CALLS_BEGIN + DS.CALLS_END,
    ],
    "granite": [
        '<|tool_call|>[{"name": "f", "arguments": {}}] and then words',
        '<|tool_call|>{"name": "f", "arguments": {}}',
        "<|tool_call|>[]",
    ],
    "phi4_mini_json": [
        'functools[{"name": "f", "arguments": {"a": [1, 2]}}',
        'functools[{"name": "f", "arguments": {}}] trailing',
        'functools[{"arguments": {}}]',
    ],
    "minimax_m2": [
        '<minimax:tool_call>\n<invoke name="two words">\n</invoke>\n</minimax:tool_call>',
        "<minimax:tool_call>\nstray text\n</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="f">\nstray<parameter name="a">1</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "Sure.<minimax:tool_call>\n</minimax:tool_call>",
    ],
    "glm45": [
        "<tool_call>two words\n</tool_call>",
        "<tool_call>{{ tc.name }}\n</tool_call>",
        "<tool_call>f\nstray text<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        '[TOOL_CALLS][{"arguments": {"a": 1}}]',
        "[TOOL_CALLS][]",
        'Sure [TOOL_CALLS][{"name": "f", "arguments": {}}, 3]',
        '[TOOL_CALLS]f[ARGS]{"a": ',
        '[TOOL_CALLS]{"a": 1}',
        "[TOOL_CALLS]two words[ARGS]{}",
        '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"b"',
    ],
}


@pytest.mark.parametrize(
    ("parser_name", "text"), [(p, t) for p, texts in MALFORMED.items() for t in texts]
)
def test_a_malformed_call_leaves_the_whole_text_as_content(parser_name: str, text: str) -> None:
    assert TOOL_PARSERS[parser_name]().parse(text) == (text, [])


PREFILL_CASES: list[tuple[ToolCallParser, str, str]] = [
    (
        HermesParser(),
        '{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        '{"a": 1}}\n</tool_call>',
    ),
    (
        Qwen3CoderParser(),
        "f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    ),
    (Llama3JsonParser(), 'f", "parameters": {"a": 1}}', '{"a": 1}}'),
    (MistralParser(), 'f", "arguments": {"a": 1}}]', '{"a": 1}}]'),
    (GraniteParser(), 'f", "arguments": {"a": 1}}]', '{"a": 1}}]'),
    (Llama4PythonicParser(), "f(a=1)]", "a=1)]"),
    (
        DeepseekV31Parser(),
        "f" + DS.SEP + '{"a": 1}' + DS.CALL_END + DS.CALLS_END,
        '{"a": 1}' + DS.CALL_END + DS.CALLS_END,
    ),
    (Phi4MiniJsonParser(), 'f", "arguments": {"a": 1}}]', '{"a": 1}}]'),
    (
        MinimaxM2Parser(),
        'f">\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>',
        '<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>',
    ),
    (
        Glm45Parser(),
        "f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        "<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    ),
]
PREFILL_IDS = [parser.name for parser, _, _ in PREFILL_CASES]


@pytest.mark.parametrize(("parser", "rest_any", "rest_named"), PREFILL_CASES, ids=PREFILL_IDS)
def test_the_prefill_and_its_completion_parse_to_the_call(
    parser: ToolCallParser, rest_any: str, rest_named: str
) -> None:
    expected: list[Call] = [("f", {"a": 1})]
    for text in (parser.prefill(None) + rest_any, parser.prefill("f") + rest_named):
        parsed = parser.parse(text)
        assert parsed[0] is None
        assert _calls(parsed) == expected


@pytest.mark.parametrize(("parser", "_any", "_named"), PREFILL_CASES, ids=PREFILL_IDS)
def test_a_prefill_starts_with_a_marker(parser: ToolCallParser, _any: str, _named: str) -> None:
    """So a forced call is held back from the stream from its first character."""
    for prefill in (parser.prefill(None), parser.prefill("get_weather")):
        assert any(prefill.startswith(m) for m in parser.markers)


def test_named_prefills_quote_the_name_as_json() -> None:
    assert HermesParser().prefill('a"b') == '<tool_call>\n{"name": "a\\"b", "arguments": '
    assert Llama3JsonParser().prefill("f") == '{"name": "f", "parameters": '
    assert MistralParser().prefill("f") == '[TOOL_CALLS][{"name": "f", "arguments": '
    assert Qwen3CoderParser().prefill("f") == "<tool_call>\n<function=f>\n"


# What the gateway's Hermes parsing did before the registry, kept as it was: (text, content, calls).
HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("", "", []),
    ("plain text", "plain text", []),
    (
        hermes([WEATHER]),
        None,
        [("get_weather", '{"city": "Paris", "days": 3, "units": null}')],
    ),
    (
        "Thinking...\n" + hermes([WEATHER, SEARCH]) + "\ntrailing words",
        "Thinking...",
        [
            ("get_weather", '{"city": "Paris", "days": 3, "units": null}'),
            ("web.search", '{"query": "tool calls", "filters": {"site": ["a.org"], "n": 2.5}}'),
        ],
    ),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>', None, [("f", '{"a": 1}')]),
    (
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", "{}")]),
    (
        '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>',
        None,
        [("f", '{"a": "\\u00e9"}')],
    ),
    (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        [],
    ),
    ("<tool_call>\n[1]\n</tool_call>", "<tool_call>\n[1]\n</tool_call>", []),
    (
        '   \n<tool_call>{"name": "f", "arguments": {}}</tool_call>between<tool_call>'
        '{"name": "g", "arguments": [1]}</tool_call>',
        None,
        [("f", "{}"), ("g", "[1]")],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parses_as_the_gateway_always_has(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    assert HermesParser().parse(text) == (content, [ParsedToolCall(*c) for c in calls])


def test_qwen3_coder_values_are_json_when_they_parse_else_text() -> None:
    params = {
        "n": "42",
        "flag": "true",
        "nothing": "null",
        "obj": '{"k": [1, 2]}',
        "word": "hello world",
        "not_a_number": "NaN",
        "padded": "  padded ",
        "lines": "line 1\nline 2\n",
    }
    text = qwen3([("f", params)])
    (call,) = Qwen3CoderParser().parse(text)[1]
    assert list(json.loads(call.arguments).items()) == [
        ("n", 42),
        ("flag", True),
        ("nothing", None),
        ("obj", {"k": [1, 2]}),
        ("word", "hello world"),
        ("not_a_number", "NaN"),
        ("padded", "  padded "),
        ("lines", "line 1\nline 2\n"),
    ]


def test_qwen3_coder_reads_a_bare_function_and_unclosed_tags_at_the_end() -> None:
    parser = Qwen3CoderParser()
    bare = "I'll run it.\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n</function>"
    assert parser.parse(bare)[0] == "I'll run it."
    assert _calls(parser.parse(bare)) == [("run", {"cmd": "ls -la"})]
    cut = "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n<parameter=n>\n2"
    assert _calls(parser.parse(cut)) == [("run", {"cmd": "ls", "n": 2})]


def test_llama3_json_takes_the_tag_arguments_and_semicolons_in_strings() -> None:
    text = '<|python_tag|>{"name": "f", "arguments": {"s": "a; b"}};{"name": "g", "parameters": {}}'
    assert Llama3JsonParser().parse(text) == (
        None,
        [ParsedToolCall("f", '{"s": "a; b"}'), ParsedToolCall("g", "{}")],
    )


def test_llama3_json_needs_a_marker_so_other_spacing_is_text() -> None:
    """What the stream showed as text (no marker held it back) stays text."""
    text = '{ "name": "f", "parameters": {}}'
    assert Llama3JsonParser().parse(text) == (text, [])


def test_mistral_reads_both_forms_and_drops_text_after_the_array() -> None:
    parser = MistralParser()
    array = '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]</s>'
    assert _calls(parser.parse(array)) == [("f", {"a": 1})]
    no_args_token = 'Hm. [TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{}'
    assert parser.parse(no_args_token)[0] == "Hm."
    assert _calls(parser.parse(no_args_token)) == [("f", {"a": 1}), ("g", {})]


TEMPLATES = {
    "qwen3_coder": (
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
        "value_1\n</parameter>\n</function>\n</tool_call>"
    ),
    "hermes": (
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    ),
    "mistral": "{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- endif %}",
    "llama3_json": '{{- "<|python_tag|>" + tool_call.name + ".call(" }}',
}


GLM45_CALLS = (
    "{%- for tc in m.tool_calls %}{{- '<tool_call>' + tc.name }}"
    "{% for k, v in tc.arguments.items() %}\n<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v }}</arg_value>{% endfor %}\n</tool_call>"
    "{% endfor %}"
)


@pytest.mark.parametrize(("expected", "template"), list(TEMPLATES.items()))
def test_the_template_picks_the_parser(expected: str, template: str) -> None:
    assert detect_tool_parser(template) == expected
    assert build_tool_parser("auto", template).name == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.",
            "llama3_json",
        ),
        ("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}", None),
        ("", None),
        # GLM-4.5's calls open with `<tool_call>` too, then a name and key/value tags
        (GLM45_CALLS, "glm45"),
    ],
)
def test_a_llama_instruction_or_nothing_recognisable(template: str, expected: str | None) -> None:
    """Nothing recognisable is no parser, never a guess (hermes would read GLM's calls as text)."""
    assert detect_tool_parser(template) == expected
    parser = build_tool_parser("auto", template)
    assert (parser.name == expected) if expected else isinstance(parser, NoToolParser)


def test_no_parser_reads_every_reply_as_text() -> None:
    parser = NoToolParser()
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parser.parse(text) == (text, [])
    assert parser.markers == ()
    assert parser.grammar([], None, True, {}) is None


def test_the_registry_builds_each_parser_by_its_name() -> None:
    for name, cls in TOOL_PARSERS.items():
        assert cls.name == name
        assert type(build_tool_parser(name, TEMPLATES["mistral"])) is cls


def test_an_unknown_parser_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'nope'") as info:
        build_tool_parser("nope", "")
    for known in ("auto", *TOOL_PARSERS):
        assert known in str(info.value)


def test_the_module_imports_no_torch() -> None:
    code = (
        "import sys, gateway.core.tool_parsers\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
