"""The fence between an agent and its workers (efdl.worker.fence): a deadline in a file the
agent writes as it reaches etcd, read by its workers at each commit; a fenced commit waits,
state in memory, and goes on once the agent reaches etcd again, or leaves its generation when
the agent has since placed it in a newer one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from efdl.protocol.messages import Placement
from efdl.worker import state as state_module
from efdl.worker.commit import Flag
from efdl.worker.fence import Fence, FenceWriter
from efdl.worker.runtime import get_runtime
from efdl.worker.state import ElasticState, Fenced
from tests.wait import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_moves_on_with_each_contact_and_never_back(tmp_path: Path) -> None:
    clock = Clock()
    writer = FenceWriter(tmp_path / "fence", 30.0, clock)
    reader = Fence(str(tmp_path / "fence"), clock)
    assert reader.deadline() == 130.0 and reader.open()
    writer.reached(110.0)
    assert reader.deadline() == 140.0
    writer.reached(105.0)  # an older refresh's answer, late: the deadline stays
    assert reader.deadline() == 140.0
    clock.now = 141.0
    assert not reader.open() and not writer.open()
    assert reader.closed_for() == pytest.approx(1.0)
    assert (tmp_path / "fence").stat().st_mode & 0o777 == 0o600
    writer.close()


class _Channel:
    """What the fenced commit asks of the agent's channel."""

    def __init__(self) -> None:
        self.leave_requested = False
        self.closed = False
        self.newer = False

    def superseded(self, generation: int) -> bool:
        return self.newer

    def pending(self, generation: int) -> bool:
        return False

    def notify(self, message: dict[str, object]) -> None:
        pass


@pytest.fixture()
def fenced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ElasticState, FenceWriter]:
    """A state whose agent's fence has closed (its agent last reached etcd 100 s ago)."""
    writer = FenceWriter(tmp_path / "fence", 30.0, clock=lambda: time.monotonic() - 100.0)
    monkeypatch.setattr(state_module, "fence", lambda: Fence(str(tmp_path / "fence")))
    rt = get_runtime()
    monkeypatch.setattr(rt, "channel", _Channel())
    monkeypatch.setattr(rt, "placement", Placement(3, 0, 1, 0, 1, 0, 1, "127.0.0.1", 1))
    monkeypatch.setattr(rt, "join_timeout_s", 30.0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model, opt, epoch=0)
    # The agreement of the commit before has completed (all flags 0).
    monkeypatch.setattr(state._agreement, "read", lambda: [0] * len(Flag))
    return state, writer


def test_a_fenced_commit_waits_until_the_agent_reaches_etcd_again(
    fenced: tuple[ElasticState, FenceWriter], caplog: pytest.LogCaptureFixture
) -> None:
    state, writer = fenced
    failed: list[BaseException] = []

    def train() -> None:
        try:
            state.commit()
        except BaseException as exc:
            failed.append(exc)

    with caplog.at_level("WARNING"):
        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        wait_until("the commit to stop at the fence", lambda: "fence timeout" in caplog.text, 10)
        assert trainer.is_alive() and not failed  # it waits, state in memory
        writer.reached(time.monotonic())  # the agent reached etcd again
        trainer.join(timeout=10)
    assert not trainer.is_alive() and not failed, failed
    assert state.step == 1 and "reached etcd again" in caplog.text


def test_a_fenced_commit_leaves_its_generation_once_placed_in_a_newer_one(
    fenced: tuple[ElasticState, FenceWriter],
) -> None:
    state, _ = fenced
    channel = get_runtime().channel
    assert isinstance(channel, _Channel)
    channel.newer = True  # the agent reached etcd, learned of a round that replaced this one
    with pytest.raises(Fenced, match="Fenced at step 1"):
        state.commit()
