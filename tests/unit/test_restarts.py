"""--max-restarts and the deterministic failure: the same error again with no step trained
between is not restarted; anything else is, while the budget lasts."""

from __future__ import annotations

from efdl.launcher.restarts import RestartBudget, Verdict


class _Node:
    """A node's budget through a run of failures (the agent keeps each judgement's)."""

    def __init__(self, max_restarts: int) -> None:
        self.budget = RestartBudget(max_restarts)

    def decide(self, code: int, error: str, step: int | None) -> Verdict:
        judged = self.budget.judge(code, error, step)
        self.budget = judged.budget
        return judged.verdict


def test_the_same_error_twice_without_a_step_between_ends_the_node() -> None:
    node = _Node(3)
    assert node.decide(1, "ValueError: bad flag", None) is Verdict.RESTART
    assert node.decide(1, "ValueError: bad flag", None) is Verdict.REPEATED
    assert node.budget.used == 1


def test_a_step_trained_between_or_another_error_is_restarted() -> None:
    node = _Node(3)
    assert node.decide(1, "RuntimeError: NCCL timeout", 100) is Verdict.RESTART
    assert node.decide(1, "RuntimeError: NCCL timeout", 250) is Verdict.RESTART  # trained
    assert node.decide(1, "OSError: disk full", 250) is Verdict.RESTART  # another error
    assert node.decide(1, "OSError: disk full", 250) is Verdict.REPEATED


def test_signals_and_unknown_errors_only_spend_the_budget() -> None:
    node = _Node(2)
    assert node.decide(-9, "", None) is Verdict.RESTART  # SIGKILL: someone else's doing
    assert node.decide(-9, "", None) is Verdict.RESTART
    assert node.decide(1, "", None) is Verdict.EXHAUSTED
    assert node.budget.used == 2


def test_no_restarts_allowed_ends_at_the_first_failure() -> None:
    assert RestartBudget(0).judge(1, "ValueError: x", None).verdict is Verdict.EXHAUSTED


def test_judging_leaves_the_budget_it_was_asked_of_as_it_was() -> None:
    budget = RestartBudget(3)
    assert budget.judge(1, "ValueError: x", None).budget.used == 1
    assert budget.used == 0 and budget.last is None
