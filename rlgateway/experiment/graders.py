"""The built-in reward functions, by the name a spec gives them (`GRADERS`).

Each has the reward signature `fn(prompt, completion, row) -> float` and reads what it checks
against from the row: `answer` (math_answer, exact_match), `pattern` (regex), `schema`
(json_schema). A grader returns 1.0 or 0.0; a mistake in the row itself (a bad pattern, an
invalid schema, a missing field) raises, and `RewardRunner` records it as an error.

`math_answer` takes the completion's final answer (a `\\boxed{...}`, else what follows a final
`####`, else an "answer is X" / "Answer: X", else the last number) and the reference (a GSM8K
worked answer's text after `####`, or the whole `answer`). Two plain numbers (integers, decimals,
`a/b`, `\\frac{a}{b}`, thousands commas) are compared exactly as rationals, in microseconds;
anything else goes to `math_verify` (Hugging Face's answer checker: LaTeX, sets, intervals,
equations) when it is installed, else to sympy (`simplify(a - b) == 0` over a small, sanitised
expression language). Candidates that would stall a symbolic checker (over 200 characters, deep
nesting, power towers, huge exponents or factorials) count as wrong. `math_verify`'s own
timeouts use `signal.alarm`, which works only on a main thread, so they are off: the runner's
timeout bounds a grading instead.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

Row = dict[str, Any]


def math_answer(prompt: str, completion: str, row: Row) -> float:
    """1.0 when the completion's final answer equals `row["answer"]` (module docstring)."""
    got = final_answer(completion)
    if got is None:
        return 0.0
    return 1.0 if answers_match(reference_answer(str(row["answer"])), got) else 0.0


def exact_match(prompt: str, completion: str, row: Row) -> float:
    """1.0 when the completion, stripped, is `row["answer"]` (stripped, case-sensitive)."""
    return 1.0 if completion.strip() == str(row["answer"]).strip() else 0.0


def regex(prompt: str, completion: str, row: Row) -> float:
    """1.0 when the stripped completion matches the regular expression `row["pattern"]` whole
    (`re.fullmatch`). A pattern that does not compile raises."""
    return 1.0 if re.fullmatch(row["pattern"], completion.strip()) else 0.0


def json_schema(prompt: str, completion: str, row: Row) -> float:
    """1.0 when the completion is JSON (the whole of it, no code fence) that validates against
    `row["schema"]` (a dict, or its JSON text). An invalid schema raises."""
    import jsonschema  # type: ignore[import-untyped]

    schema = row["schema"]
    if isinstance(schema, str):
        schema = json.loads(schema)
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    try:
        value = json.loads(completion)
    except json.JSONDecodeError:
        return 0.0
    return 1.0 if validator_class(schema).is_valid(value) else 0.0


GRADERS: dict[str, Callable[[str, str, Row], float]] = {
    "math_answer": math_answer,
    "exact_match": exact_match,
    "regex": regex,
    "json_schema": json_schema,
}
"""The built-in reward functions by the name a spec gives them."""


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_LAST_NUMBER = re.compile(rf"(?:(?<![\w)\]}}])-)?{_NUMBER}")
_LEADING_NUMBER = re.compile(rf"-?{_NUMBER}(?![\w^/])")
_PLAIN_NUMBER = re.compile(r"(-?)(?:(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?|(\d+)/(\d+))")
_LATEX_FRAC = re.compile(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_UNITS = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}")
_STALLS = re.compile(
    r"\^\s*\{[^{}]*\^"  # a power tower, 9^{9^{9}}
    r"|\^\s*\d+\s*\^|\*\*[^*]*\*\*"
    r"|(?:\^|\*\*)\s*\{?\s*-?\d{4,}"  # an exponent of four digits or more
    r"|\d{4,}\s*!"  # a factorial of a four-digit number
)
_MAX_LENGTH = 200
_MAX_DEPTH = 8


def final_answer(text: str) -> str | None:
    """The completion's final answer, in order of preference: the last `\\boxed{...}`, what
    follows the last `####`, the last "answer is X" / "Answer: X", the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marker = text.rfind("####")
    if marker >= 0:
        after = text[marker + 4 :].strip().split("\n", 1)[0].strip()
        if after:
            return after
    said = [m.group(1).strip() for m in _ANSWER_IS.finditer(text)]
    if said and said[-1]:
        return said[-1]
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(answer: str) -> str:
    """The reference's final answer: what follows the last `####` of a GSM8K worked answer,
    else the whole text (stripped)."""
    marker = answer.rfind("####")
    return (answer[marker + 4 :] if marker >= 0 else answer).strip()


def answers_match(reference: str, answer: str) -> bool:
    """Whether `answer` equals `reference`: exactly as rationals when both are plain numbers,
    else symbolically (module docstring). Never raises."""
    ref, got = _clean(reference), _clean(answer)
    ref_number, got_number = _as_fraction(ref), _as_fraction(got)
    if ref_number is not None and got_number is not None:
        return ref_number == got_number
    if not ref or not got or _stalls(ref) or _stalls(got):
        return False
    verify = _math_verify()
    return verify(ref, got) if verify is not None else _sympy_equal(ref, got)


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces close (one pass over the braces)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    closing: dict[int, int] = {}
    opened: list[int] = []
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            opened.append(brace.end())
        elif opened:
            closing[opened.pop()] = brace.start()
    for start in reversed(starts):
        if start in closing:
            return text[start : closing[start]]
    return None


def _clean(answer: str) -> str:
    """Strip what is not the value: `$` signs, units in `\\text{}`, a trailing period, `%`, and
    words after a leading number ("12 apples." -> "12")."""
    s = _UNITS.sub("", answer).replace("\\$", "").replace("\\%", "").replace("{,}", ",")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = s.strip().strip("$").strip().rstrip(".").strip().rstrip("%").strip()
    if s.startswith("$"):
        s = s[1:].strip()
    leading = _LEADING_NUMBER.match(s)
    if leading and re.fullmatch(r"[\s.,;:!]*(?:[A-Za-z][^\\]*)?", s[leading.end() :]):
        return leading.group(0)
    return s


def _as_fraction(s: str) -> Fraction | None:
    m = _PLAIN_NUMBER.fullmatch(s)
    if m is not None and len(s) <= _MAX_LENGTH:
        sign, whole, decimals, numerator, denominator = m.groups()
        if whole is not None:
            value = Fraction(whole.replace(",", "") + (decimals or ""))
        elif int(denominator) == 0:
            return None
        else:
            value = Fraction(int(numerator), int(denominator))
        return -value if sign else value
    m = _LATEX_FRAC.fullmatch(s)
    if m is not None and len(s) <= _MAX_LENGTH and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    return None


def _stalls(s: str) -> bool:
    """Whether a symbolic checker could stall on `s` (module docstring)."""
    if len(s) > _MAX_LENGTH or _STALLS.search(s):
        return True
    depth = deepest = 0
    for ch in s:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        deepest = max(deepest, depth)
    return deepest > _MAX_DEPTH


@functools.cache
def _math_verify() -> Callable[[str, str], bool] | None:
    """`math_verify`'s comparison of two answers, or None when it is not installed."""
    try:
        from math_verify import parse, verify  # type: ignore[import-untyped]
    except ImportError:
        return None
    # it warns once that its own (signal-based) timeouts are off: the runner's bound a grading
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_timeouts_off_filter)

    def equal(reference: str, answer: str) -> bool:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
        target = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
        return bool(gold and target and verify(gold, target, timeout_seconds=None))

    return equal


def _timeouts_off_filter(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


_SYMPY_WORDS = frozenset({"sqrt", "pi"})
_SYMPY_TEXT = re.compile(r"[0-9a-z+\-*/^().\s]+")
_LATEX_TO_SYMPY = (
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi\b"), "pi"),
    (re.compile(r"(?<=\d),(?=\d{3}\b)"), ""),
)


def _sympy_equal(reference: str, answer: str) -> bool:
    """The fallback without `math_verify`: `simplify(a - b) == 0` over arithmetic in numbers,
    one-letter variables, `sqrt` and `pi` (parse_expr evaluates Python, so nothing else is let
    through), with `\\frac`, `\\sqrt`, `\\cdot` and `\\pi` translated from LaTeX."""
    import sympy  # type: ignore[import-untyped]
    from sympy.parsing.sympy_parser import (  # type: ignore[import-untyped]
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (
        *standard_transformations,
        implicit_multiplication_application,
        convert_xor,
    )
    exprs = []
    for text in (reference, answer):
        for pattern, replacement in _LATEX_TO_SYMPY * 2:  # twice: \frac{\sqrt{2}}{\sqrt{3}}
            text = pattern.sub(replacement, text)
        words = re.findall(r"[a-z]+", text)
        if not _SYMPY_TEXT.fullmatch(text) or any(
            len(w) > 1 and w not in _SYMPY_WORDS for w in words
        ):
            return False
        exprs.append(text)
    # garbage that passed the filter ("(1", "1//") is a wrong answer, whatever sympy raises
    try:
        a, b = (parse_expr(text, transformations=transformations) for text in exprs)
        return bool(sympy.simplify(a - b) == 0)
    except Exception:
        return False
