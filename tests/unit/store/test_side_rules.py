"""The run's side request rules (`store.run_config.SideRule`): which requests they mark, and the
configs they refuse, with the key named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from store.run_config import RunConfig, SideRule

TITLE = "Summarize this coding conversation in under 50 characters. Write a title."


def rule(**conditions: object) -> SideRule:
    return SideRule.model_validate({"name": "r", **conditions})


def test_a_system_pattern_is_searched_in_the_system_prompt() -> None:
    r = rule(system=r"(?i)write a title")
    assert r.matches(TITLE, 100, {})
    assert not r.matches("You are a coding agent.", 100, {})
    assert not r.matches("", None, {})  # no system prompt: never a match


def test_a_max_tokens_bound_marks_requests_asking_fewer() -> None:
    r = rule(max_tokens_below=2)
    assert r.matches("", 1, {})
    assert not r.matches("", 2, {})
    assert not r.matches("", None, {})  # asking none is not asking few


def test_a_header_marks_requests_that_carry_it_in_any_case() -> None:
    r = rule(header="X-Side-Request")
    assert r.matches("", None, {"x-side-request": ""})
    assert not r.matches("", None, {"x-other": "1"})


def test_every_condition_of_a_rule_must_hold() -> None:
    r = rule(system="title", max_tokens_below=64)
    assert r.matches(TITLE, 32, {})
    assert not r.matches(TITLE, 64, {})
    assert not r.matches("an agent", 32, {})


def test_the_first_matching_rule_names_the_request() -> None:
    run = RunConfig.model_validate(
        {
            "side_requests": [
                {"name": "title", "system": "title"},
                {"name": "quota", "max_tokens_below": 2},
            ]
        }
    )
    assert run.side_rule(TITLE, 1, {}) == "title"
    assert run.side_rule("an agent", 1, {}) == "quota"
    assert run.side_rule("an agent", 8, {}) is None
    assert RunConfig().side_rule(TITLE, 1, {}) is None  # no rules: every request is the agent's


@pytest.mark.parametrize(
    ("rules", "needles"),
    [
        ([{"name": "r"}], ["sets no condition", "max_tokens_below"]),
        ([{"name": "r", "system": "(unclosed"}], ["system", "not a regular expression"]),
        ([{"name": "r", "max_tokens_below": 0}], ["max_tokens_below"]),
        ([{"name": "r", "header": "bad header"}], ["header"]),
        ([{"name": "a b", "header": "x"}], ["name"]),
        ([{"name": "r", "header": "x", "tokens": 1}], ["tokens"]),
        ([{"name": "r", "header": "x"}, {"name": "r", "system": "y"}], ["share a name: r"]),
    ],
)
def test_a_bad_rule_is_refused_naming_what_is_wrong(
    rules: list[dict[str, object]], needles: list[str]
) -> None:
    with pytest.raises(ValidationError) as exc:
        RunConfig.model_validate({"side_requests": rules})
    text = str(exc.value)
    assert "side_requests" in text
    for needle in needles:
        assert needle in text, text
