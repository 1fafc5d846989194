"""The engine process's restart budget (`engines.process_supervisor.RestartBudget`): the backoff
doubles with each death within the window up to its cap, deaths age out of the window, and one
death more than the policy allows gets no restart."""

from __future__ import annotations

from engines.process_child import RestartPolicy
from engines.process_supervisor import RestartBudget


def test_the_backoff_doubles_up_to_its_cap_and_the_budget_runs_out() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=4, window_s=60, backoff_s=1, max_backoff_s=5))
    assert [budget.next_delay(t) for t in (0, 1, 2, 3)] == [1, 2, 4, 5]
    assert budget.next_delay(4) is None  # a fifth death within 60 s: stay down
    assert len(budget.deaths) == 4  # the refused one is not counted


def test_deaths_age_out_of_the_window() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=10, backoff_s=0.5))
    assert budget.next_delay(0) == 0.5
    assert budget.next_delay(5) == 1.0
    assert budget.next_delay(9) is None
    assert budget.next_delay(14) == 1.0  # the death at 0 left the window; the one at 5 is in it
    assert budget.next_delay(30) == 0.5  # both older ones left it


def test_no_restarts_allowed_means_none_at_the_first_death() -> None:
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0) is None
