"""One-off etcd calls of the rendezvous survive a blip, and a retried write that was applied
the first time is recognised as done (in-memory store: the contract suite runs it on etcd)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from efdl.errors import LeaseLostError, StoreAuthError, StoreConnectionError
from efdl.rendezvous.api import Compare, Op, TxnResult
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.memory_store import MemoryStore
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.reading import retried
from efdl.rendezvous.records import NodeRecord


class LostAnswers(MemoryStore):
    """Applies the first transaction, loses its answer and applies it again: what a client
    sees when a member applied a write but did not answer in time and it was retried."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_next = True

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        if self.lose_next:
            self.lose_next = False
            super().txn(compare, success, failure)
        return super().txn(compare, success, failure)


def test_a_join_applied_then_retried_is_not_a_duplicate() -> None:
    store = LostAnswers()
    record = NodeRecord("ip-10-0-0-1.ec2.internal-ab12cd", "10.0.0.1", 29500, 8)
    agent = Participant(store, "job", record, Policy(1, 8), lease_ttl_s=5)
    try:
        agent.join()  # raised DuplicateNodeError when a retried first attempt had been applied
        r = agent.next_round(after=0, timeout_s=10)
        assert r is not None and r.member is not None and r.member.node_id == record.node_id
    finally:
        agent.leave()
        store.close()


def test_retried_goes_through_a_blip_and_gives_up_at_its_deadline() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreConnectionError("etcd at 127.0.0.1:2379 did not answer")
        return "done"

    assert retried("do it", flaky, timeout_s=5, pause_s=0.01) == "done" and len(calls) == 3

    def down() -> str:
        raise StoreConnectionError("etcd at 127.0.0.1:2379 did not answer")

    with pytest.raises(StoreConnectionError):
        retried("do it", down, timeout_s=0.05, pause_s=0.01)


@pytest.mark.parametrize(
    "error",
    [
        StoreAuthError("etcd at 127.0.0.1:2379 refused user 'train': permission denied"),
        LeaseLostError("lease 1f expired"),
    ],
)
def test_retried_gives_up_at_once_on_what_waiting_cannot_fix(error: Exception) -> None:
    """A refused role or a lost lease is not a blip: one call, the error, no 30 s of retries."""
    calls = []

    def refused() -> str:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        retried("do it", refused, timeout_s=5, pause_s=0.01)
    assert len(calls) == 1
