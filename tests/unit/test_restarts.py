"""--max-restarts and the deterministic failure: the same error again with no step trained
between is not restarted; anything else is, while the budget lasts."""

from __future__ import annotations

from efdl.launcher.restarts import RestartBudget, Verdict


def test_the_same_error_twice_without_a_step_between_ends_the_node() -> None:
    budget = RestartBudget(3)
    assert budget.decide(1, "ValueError: bad flag", None) is Verdict.RESTART
    assert budget.decide(1, "ValueError: bad flag", None) is Verdict.REPEATED
    assert budget.used == 1


def test_a_step_trained_between_or_another_error_is_restarted() -> None:
    budget = RestartBudget(3)
    assert budget.decide(1, "RuntimeError: NCCL timeout", 100) is Verdict.RESTART
    assert budget.decide(1, "RuntimeError: NCCL timeout", 250) is Verdict.RESTART  # trained
    assert budget.decide(1, "OSError: disk full", 250) is Verdict.RESTART  # another error
    assert budget.decide(1, "OSError: disk full", 250) is Verdict.REPEATED


def test_signals_and_unknown_errors_only_spend_the_budget() -> None:
    budget = RestartBudget(2)
    assert budget.decide(-9, "", None) is Verdict.RESTART  # SIGKILL: someone else's doing
    assert budget.decide(-9, "", None) is Verdict.RESTART
    assert budget.decide(1, "", None) is Verdict.EXHAUSTED
    assert budget.used == 2


def test_no_restarts_allowed_ends_at_the_first_failure() -> None:
    assert RestartBudget(0).decide(1, "ValueError: x", None) is Verdict.EXHAUSTED
