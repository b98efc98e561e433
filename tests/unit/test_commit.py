"""A commit copies nothing, and the optimizer's own hooks tell what a failure leaves: real
torch modules and optimizers, no process group."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from efdl.protocol.messages import Placement
from efdl.worker.runtime import Runtime
from efdl.worker.state import ElasticState
from efdl.worker.sync import said_setup
from efdl.worker.transaction import Recovery, Standing, StepPhase


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def tensor_ops(fn: Callable[[], object]) -> list[str]:
    with _Ops() as log:
        fn()
    return log.ops


def trained(snapshot_every: int = 0) -> tuple[ElasticState, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ElasticState(model, opt, snapshot_every=snapshot_every, epoch=0)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return state, opt


def test_a_commit_runs_no_tensor_operation_on_the_state() -> None:
    state, _ = trained()
    assert tensor_ops(state.commit) == []
    assert state.step == 1 and state.phase is StepPhase.COMMITTED


def test_rollback_copies_are_made_only_when_asked_for() -> None:
    state, _ = trained(snapshot_every=1)
    assert "aten.clone.default" in tensor_ops(state.commit)


def test_the_optimizer_hooks_mark_the_phases() -> None:
    state, opt = trained()
    assert state.phase is StepPhase.STEPPED  # optimizer.step() ran, commit() not yet
    state.commit()
    assert state.phase is StepPhase.COMMITTED
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("in step")))
    with pytest.raises(RuntimeError, match="in step"):
        opt.step()
    assert state.phase is StepPhase.STEPPING  # failed inside optimizer.step()


def test_a_failure_after_the_step_counts_it_and_one_inside_it_holds_nothing() -> None:
    state, opt = trained()
    state._tree.holds = True  # as after a sync
    cursor_step = state.step
    assert state.recover() is Recovery.ROLL_FORWARD
    assert state.step == cursor_step + 1 and state.standing() == Standing(1, settled=False)
    assert all(p.grad is None for p in state.model.parameters())  # the step's grads dropped
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("in step")))
    with pytest.raises(RuntimeError):
        opt.step()
    assert state.recover() is Recovery.DISCARD
    assert state.standing() == Standing(None, torn=True)


def test_a_failure_before_the_step_keeps_the_last_commit() -> None:
    state, _ = trained()
    state.commit()
    state._tree.holds = True
    before = [p.detach().clone() for p in state.model.parameters()]
    state.model(torch.randn(4, 64)).sum().backward()  # a backward that then fails
    assert state.recover() is Recovery.KEEP
    assert state.standing() == Standing(1)
    after = list(state.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_snapshot_every_must_be_a_count() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="snapshot_every is -1"):
        ElasticState(model, snapshot_every=-1)


@pytest.mark.parametrize(
    ("since_s", "said"),
    [(2.0, True), (0.2, False), (None, False)],  # None: it declared at its entry (gloo)
)
def test_a_newcomer_that_held_the_others_up_says_so(
    since_s: float | None, said: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer that declared itself at its join (NCCL) made the others wait in the sync for
    its setup: over SETUP_SAID_S it says so; one that declared at its entry held nobody up."""
    rt = Runtime()
    rt.placement = Placement(2, 2, 3, 0, 1, 2, 3, "127.0.0.1", 1, job_step=40)
    rt.held_up_since = None if since_s is None else time.monotonic() - since_s
    state, _ = trained()
    with caplog.at_level("WARNING"):
        said_setup(state.generation, rt)
    assert ("for this newcomer's setup" in caplog.text) is said
