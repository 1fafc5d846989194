"""Reward functions: found from a spec's string, run under a timeout in threads, processes or on
the loop without ever raising, and the built-in graders on the answers models actually write."""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgateway.experiment import graders
from rlgateway.experiment.graders import (
    GRADERS,
    exact_match,
    final_answer,
    json_schema,
    math_answer,
    regex,
)
from rlgateway.experiment.rewards import (
    FileFunction,
    RewardError,
    RewardOutcome,
    RewardRunner,
    resolve_reward,
)

RELEASE = threading.Event()
"""Lets the hung thread of the thread-pool timeout test finish when the test does."""


def plain(prompt: str, completion: str, row: dict[str, Any]) -> Any:
    return row["value"]


async def coroutine(prompt: str, completion: str, row: dict[str, Any]) -> Any:
    await asyncio.sleep(0)
    return row["value"]


def raising(prompt: str, completion: str, row: dict[str, Any]) -> float:
    raise ValueError(f"cannot grade {completion!r}")


async def async_raising(prompt: str, completion: str, row: dict[str, Any]) -> float:
    raise KeyError("answer")


def hanging(prompt: str, completion: str, row: dict[str, Any]) -> float:
    RELEASE.wait(30)
    return 1.0


async def async_hanging(prompt: str, completion: str, row: dict[str, Any]) -> float:
    await asyncio.sleep(30)
    return 1.0


@pytest.fixture
def runners() -> Iterator[list[RewardRunner]]:
    made: list[RewardRunner] = []
    RELEASE.clear()
    yield made
    RELEASE.set()
    for runner in made:
        runner.close()


def runner(made: list[RewardRunner], fn: Any, **kw: Any) -> RewardRunner:
    made.append(RewardRunner(fn, **kw))
    return made[-1]


# --- running ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [plain, coroutine])
@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.25, 0.25), (3, 3.0), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0)],
)
async def test_a_number_or_bool_is_ok(
    runners: list[RewardRunner], fn: Any, value: Any, expected: float
) -> None:
    outcome = await runner(runners, fn)("p", "c", {"value": value})
    assert outcome == RewardOutcome(expected, "ok", "")
    assert type(outcome.value) is float


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        (math.nan, "returned nan: a reward must be finite"),
        (-math.inf, "returned -inf: a reward must be finite"),
        pytest.param(10**400, "returned 1000000000", id="huge-int"),
        ("1.0", "returned '1.0' (str): a reward is a number or a bool"),
        (None, "returned None (NoneType): a reward is a number or a bool"),
        ([1.0], "returned [1.0] (list): a reward is a number or a bool"),
    ],
)
async def test_a_value_that_is_not_a_finite_number_is_invalid(
    runners: list[RewardRunner], value: Any, detail: str
) -> None:
    outcome = await runner(runners, plain)("p", "c", {"value": value})
    assert outcome.status == "invalid"
    assert outcome.value is None
    assert outcome.detail.startswith(detail)


async def test_a_raise_is_an_error_with_its_type_and_message(runners: list[RewardRunner]) -> None:
    assert await runner(runners, raising)("p", "oops", {}) == RewardOutcome(
        None, "error", "ValueError: cannot grade 'oops'"
    )
    assert await runner(runners, async_raising)("p", "c", {}) == RewardOutcome(
        None, "error", "KeyError: 'answer'"
    )


@pytest.mark.parametrize("fn", [hanging, async_hanging])
async def test_a_hang_is_a_timeout(runners: list[RewardRunner], fn: Any) -> None:
    run = runner(runners, fn, timeout=0.3)
    start = time.monotonic()
    outcome = await run("p", "c", {})
    # long before the grader would return (30 s): a bound on behaviour, not on speed
    assert time.monotonic() - start < 15
    assert outcome == RewardOutcome(None, "timeout", "no value after 0.3 s")


async def test_the_timeout_counts_from_the_start_not_the_wait_for_a_slot(
    runners: list[RewardRunner],
) -> None:
    def slow(prompt: str, completion: str, row: dict[str, Any]) -> float:
        time.sleep(0.2)
        return 1.0

    run = runner(runners, slow, timeout=0.35, max_workers=1)
    outcomes = await asyncio.gather(*(run("p", "c", {}) for _ in range(3)))
    assert [o.status for o in outcomes] == ["ok"] * 3


async def test_counts_per_status(runners: list[RewardRunner]) -> None:
    run = runner(runners, plain)
    for value in (1, 0.5, math.nan, "x"):
        await run("p", "c", {"value": value})
    await run("p", "c", {})  # KeyError
    assert run.counts == {"ok": 2, "error": 1, "timeout": 0, "invalid": 2}


def file_reward(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "import os, time\n"
        "def score(prompt, completion, row):\n"
        "    if completion == 'hang':\n"
        "        time.sleep(60)\n"
        "    if completion == 'raise':\n"
        "        raise RuntimeError('bad row')\n"
        "    if completion == 'pid':\n"
        "        return os.getpid()\n"
        "    return len(completion)\n"
        "async def ascore(prompt, completion, row):\n"
        "    return 1\n"
        "NOT_A_FUNCTION = 3\n"
        "def two_args(prompt, completion):\n"
        "    return 1\n"
    )
    return path


async def test_a_process_pool_kills_a_hung_worker_and_keeps_working(
    tmp_path: Path, runners: list[RewardRunner]
) -> None:
    file_reward(tmp_path)
    fn = resolve_reward("my_rewards.py:score", base_dir=tmp_path)
    run = runner(runners, fn, executor="process", timeout=0.5, max_workers=1)
    assert await run("p", "four", {}) == RewardOutcome(4.0, "ok", "")
    first_pid = (await run("p", "pid", {})).value
    for _ in range(2):  # more hangs than workers: each one's worker is killed and replaced
        start = time.monotonic()
        assert (await run("p", "hang", {})).status == "timeout"
        assert time.monotonic() - start < 30, "it waited for the hung grader (60 s)"
    assert await run("p", "raise", {}) == RewardOutcome(None, "error", "RuntimeError: bad row")
    assert await run("p", "ok", {}) == RewardOutcome(2.0, "ok", "")
    assert (await run("p", "pid", {})).value != first_pid
    assert run.counts == {"ok": 4, "error": 1, "timeout": 2, "invalid": 0}


async def test_a_process_pool_runs_a_built_in_grader(runners: list[RewardRunner]) -> None:
    run = runner(runners, resolve_reward("math_answer"), executor="process", max_workers=2)
    rows = [{"answer": "#### 1,234"}, {"answer": "7"}]
    outcomes = await asyncio.gather(
        run("p", "so \\boxed{1234}", rows[0]), run("p", "The answer is 8.", rows[1])
    )
    assert [o.value for o in outcomes] == [1.0, 0.0]


async def test_a_function_a_worker_cannot_load_is_an_error_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runners: list[RewardRunner]
) -> None:
    # importable here when the runner is built, gone by the time a worker imports it
    (tmp_path / "vanishing_reward.py").write_text(
        "def score(prompt, completion, row):\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = runner(runners, resolve_reward("vanishing_reward:score"), executor="process")
    (tmp_path / "vanishing_reward.py").unlink()
    del sys.modules["vanishing_reward"]
    for _ in range(2):  # the second call fails at once, starting no worker
        outcome = await run("p", "c", {})
        assert outcome.status == "error"
        assert outcome.detail == (
            "RuntimeError: the reward function cannot be loaded in a worker process: "
            "ModuleNotFoundError: No module named 'vanishing_reward'"
        )


def test_a_process_pool_refuses_a_function_that_does_not_pickle() -> None:
    def local(prompt: str, completion: str, row: dict[str, Any]) -> float:
        return 1.0

    for fn in (local, lambda prompt, completion, row: 1.0):
        with pytest.raises(RewardError, match="cannot run in a process pool, it does not pickle"):
            RewardRunner(fn, executor="process")
    RewardRunner(local, executor="thread").close()


# --- resolving -------------------------------------------------------------------------------


def test_resolve_a_built_in_a_module_path_and_a_callable() -> None:
    for name, fn in GRADERS.items():
        assert resolve_reward(name) is fn
    assert resolve_reward("rlgateway.experiment.graders:exact_match") is exact_match
    assert resolve_reward(plain) is plain


def test_resolve_a_file_relative_to_the_spec(tmp_path: Path) -> None:
    file_reward(tmp_path)
    fn = resolve_reward("my_rewards.py:score", base_dir=tmp_path)
    assert fn == FileFunction(tmp_path / "my_rewards.py", "score")
    assert fn("p", "abc", {}) == 3
    # an async one is run on the loop, so it is returned as it is
    assert inspect.iscoroutinefunction(resolve_reward("my_rewards.py:ascore", base_dir=tmp_path))


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("mathanswer", "reward 'mathanswer' is not a built-in (math_answer, exact_match, regex, "),
        ("no_such_pkg.rewards:score", "cannot import module 'no_such_pkg.rewards' "),
        ("no_such_pkg.rewards:score", "ModuleNotFoundError: No module named 'no_such_pkg'"),
        ("no_such_pkg.rewards:score", "write `no_such_pkg/rewards.py:score`"),
        ("missing.py:score", "reward 'missing.py:score': file not found: {tmp}/missing.py"),
        ("my_rewards.py:nope", "reward 'my_rewards.py:nope': {tmp}/my_rewards.py has no attribute"),
        ("rlgateway.experiment.graders:nope", "module 'rlgateway.experiment.graders' has no "),
        ("my_rewards.py:NOT_A_FUNCTION", "reward 'my_rewards.py:NOT_A_FUNCTION' is a int, not a "),
        ("my_rewards.py:two_args", "takes (prompt, completion), but a reward function is called "),
        ("broken.py:f", "reward 'broken.py:f': {tmp}/broken.py failed to import (NameError: "),
    ],
)
def test_resolve_errors_say_what_is_wrong(tmp_path: Path, ref: str, message: str) -> None:
    file_reward(tmp_path)
    (tmp_path / "broken.py").write_text("undefined_name\n")
    with pytest.raises(RewardError) as info:
        resolve_reward(ref, base_dir=tmp_path)
    assert message.format(tmp=tmp_path) in str(info.value)


# --- the graders -----------------------------------------------------------------------------

GSM8K = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all she sold 1,210+24 = 1,234.\n#### 1,234"
)


@pytest.mark.parametrize(
    ("reference", "completion", "expected"),
    [
        (GSM8K, "She sold 1210 + 24 = 1234 clips.\n#### 1234", 1.0),
        (GSM8K, "So the total is \\boxed{1,234}.", 1.0),
        (GSM8K, "The answer is 1,234.", 1.0),
        (GSM8K, "Answer: $1234$", 1.0),
        (GSM8K, "Adding up, she sold 1234 clips", 1.0),
        (GSM8K, "She sold 1,233 clips.\n#### 1233", 0.0),
        ("12", "The answer is 12.", 1.0),
        ("12", "The answer is 12 apples.", 1.0),
        ("18", "Each costs $18.00.", 1.0),
        ("-5", "so x = 3 - 8, and the answer is -5", 1.0),
        ("1/2", "\\boxed{0.5}", 1.0),
        ("0.5", "The probability is 1/2", 1.0),
        ("0.75", "$\\boxed{\\dfrac{3}{4}}$", 1.0),
        ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{2}/2}", 1.0),
        ("x^2 + 1", "so it is \\boxed{1 + x^2}", 1.0),
        ("12", "\\boxed{13}", 0.0),
        ("1/3", "\\boxed{0.33}", 0.0),
        ("12", "", 0.0),
        ("12", "I do not know.", 0.0),
        # a boxed answer wins over '####', which wins over 'answer is', over the last number
        ("5", "\\boxed{5}\n#### 7", 1.0),
        ("7", "The answer is 5.\n#### 7", 1.0),
        ("5", "The answer is 5, from 2 + 3", 1.0),
        ("42", "first 3 apples, then 42", 1.0),
    ],
)
def test_math_answer(reference: str, completion: str, expected: float) -> None:
    assert math_answer("prompt", completion, {"answer": reference}) == expected


def test_final_answer_extraction() -> None:
    assert final_answer("x \\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert final_answer("\\boxed{3} and a cut-off \\boxed{\\frac{1}{") == "3"
    assert final_answer("work\n#### 72\nmore words") == "72"
    assert final_answer("Answer: 1,234 dollars") == "1,234 dollars"
    assert final_answer("pages 10-12") == "12"
    assert final_answer("nothing here") is None


NASTY = [
    "",
    "\\boxed{",
    "\\boxed{}",
    "}}}{{{",
    "\\boxed{\\frac{",
    "####",
    "#### ",
    "answer is",
    "Answer:",
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{10^{1000000}}",
    "\\boxed{100000!}",
    "1" * 10_000,
    "\\boxed{" + "(" * 100 + "1}",
    "\\boxed{" + "x" * 5000 + "}",
    "\\boxed{" * 5000,
    "\\boxed{1} " + "\\boxed{" * 5000,
    "\\boxed{1/0}",
    "1/0",
    "\\boxed{nan}",
    "\\boxed{\\infty}",
    "\x00\x01\ufffd",
    "😀 \\boxed{😀}",
    "-" * 100,
    "1,2,3,4",
    "0.1.2",
    "\\boxed{\\text{}}",
    "$$$$",
    "The answer is $",
    "\\boxed{__import__('os').system('true')}",
]


@pytest.mark.parametrize("reference", ["12", "\\frac{1}{2}", "x^2"])
def test_math_answer_never_raises_nor_stalls_on_garbage(reference: str) -> None:
    start = time.monotonic()
    for completion in NASTY:
        assert math_answer("p", completion, {"answer": reference}) in (0.0, 1.0), completion
    # the quadratic stall this guards against took 40 s on one of these strings
    assert time.monotonic() - start < 30


@settings(max_examples=100, deadline=None, database=None)
@given(st.text())
def test_math_answer_never_raises_on_any_text(completion: str) -> None:
    assert math_answer("p", completion, {"answer": "#### 7"}) in (0.0, 1.0)


def test_math_answer_compares_plain_numbers_without_the_symbolic_checker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Numbers (GSM8K's answers) are compared as rationals: the symbolic checker, tens of
    milliseconds a call, is never asked."""

    def symbolic() -> None:
        raise AssertionError("a plain number reached the symbolic checker")

    monkeypatch.setattr(graders, "_math_verify", symbolic)
    monkeypatch.setattr(graders, "_sympy_equal", symbolic)
    got = [
        math_answer("p", f"She sold {i} clips.\n#### {i:,}", {"answer": GSM8K}) for i in (1234, 7)
    ]
    assert got == [1.0, 0.0]
    assert math_answer("p", "#### 72.0", {"answer": "#### 72"}) == 1.0


@pytest.mark.parametrize(
    ("reference", "completion", "expected"),
    [
        ("x^2 + 1", "\\boxed{1 + x^2}", 1.0),
        ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{2}/2}", 1.0),
        ("2x", "\\boxed{x \\cdot 2}", 1.0),
        ("2x", "\\boxed{3x}", 0.0),
        ("1", "\\boxed{__import__('os').getpid()}", 0.0),
        ("1", "\\boxed{(1}", 0.0),
        ("1", "\\boxed{1//}", 0.0),
        ("12", "The answer is 12.", 1.0),
    ],
)
def test_math_answer_without_math_verify_falls_back_to_sympy(
    monkeypatch: pytest.MonkeyPatch, reference: str, completion: str, expected: float
) -> None:
    monkeypatch.setattr(graders, "_math_verify", lambda: None)
    assert math_answer("p", completion, {"answer": reference}) == expected


def test_exact_match() -> None:
    assert exact_match("p", "  Paris\n", {"answer": "Paris "}) == 1.0
    assert exact_match("p", "paris", {"answer": "Paris"}) == 0.0
    assert exact_match("p", "42", {"answer": 42}) == 1.0


async def test_regex(runners: list[RewardRunner]) -> None:
    assert regex("p", " 123 \n", {"pattern": r"\d{3}"}) == 1.0
    assert regex("p", "1234", {"pattern": r"\d{3}"}) == 0.0
    outcome = await runner(runners, regex)("p", "x", {"pattern": "("})
    assert outcome.status == "error"
    assert "missing ), unterminated subpattern" in outcome.detail


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("schema", [SCHEMA, '{"type": "object", "required": ["n"]}'])
def test_json_schema(schema: Any) -> None:
    assert json_schema("p", ' {"n": 3}\n', {"schema": schema}) == 1.0
    assert json_schema("p", '{"m": 3}', {"schema": schema}) == 0.0
    assert json_schema("p", "```json\n{}\n```", {"schema": schema}) == 0.0


def test_json_schema_type_checks_and_refuses_a_bad_schema() -> None:
    assert json_schema("p", '{"n": "3"}', {"schema": SCHEMA}) == 0.0
    import jsonschema

    with pytest.raises(jsonschema.SchemaError):
        json_schema("p", "{}", {"schema": {"type": 12}})
