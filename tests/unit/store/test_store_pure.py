"""The store's pure parts: database URL forms and discounted returns."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from store.db import normalize_url, redact
from store.trajectories import check_gamma, discounted_returns
from store.types import Reward


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///rlgateway.db", "sqlite+aiosqlite:///rlgateway.db"),
        ("sqlite:////var/lib/rlg/x.db", "sqlite+aiosqlite:////var/lib/rlg/x.db"),
        ("sqlite+aiosqlite:///a/b.db", "sqlite+aiosqlite:///a/b.db"),
        ("postgresql://u:pw@db:5432/rl", "postgresql+asyncpg://u:pw@db:5432/rl"),
        ("postgresql+asyncpg://u@127.0.0.1/rl", "postgresql+asyncpg://u@127.0.0.1/rl"),
    ],
)
def test_urls_normalize_to_the_async_drivers(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "mysql://u@h/db",
        "postgresql+psycopg2://u@h/db",
        "not a url",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql://u@h",
    ],
)
def test_bad_urls_say_what_is_accepted(url: str) -> None:
    with pytest.raises(ValueError, match=r"sqlite:///|PostgreSQL URL needs a database"):
        normalize_url(url)


def test_redact_hides_the_password() -> None:
    assert "secret" not in redact("postgresql+asyncpg://u:secret@h/db")


def _reward(value: float, completion_id: str | None) -> Reward:
    return Reward(value=value, completion_id=completion_id, key=None, created_at=datetime.now(UTC))


def test_discounted_returns_put_final_rewards_on_the_last_turn() -> None:
    rewards = [_reward(1.0, "a"), _reward(0.5, "b"), _reward(-0.25, "b"), _reward(2.0, None)]
    returns = discounted_returns(["a", "b", "c"], rewards, 0.9)
    assert list(returns) == ["a", "b", "c"]
    assert returns["c"] == pytest.approx(2.0)
    assert returns["b"] == pytest.approx(0.25 + 0.9 * 2.0)
    assert returns["a"] == pytest.approx(1.0 + 0.9 * (0.25 + 0.9 * 2.0))
    assert discounted_returns([], rewards, 0.9) == {}
    assert discounted_returns(["a", "b"], [_reward(1.0, None)], 0.0) == {"a": 0.0, "b": 1.0}


def test_gamma_outside_zero_one_is_refused() -> None:
    check_gamma(0.0)
    check_gamma(1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_gamma(1.5)
