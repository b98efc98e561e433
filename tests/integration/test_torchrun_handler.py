"""efdl's torchrun rendezvous handler against torch's documented contract, on a real etcd:
RendezvousInfo, waiting counts, repeated next_rendezvous after a restart, closing, timeouts,
shutdown. (tests/e2e/test_torchrun_backend.py runs it under real torchrun.)"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from efdl.errors import ConfigError
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.torchrun import EfdlRendezvousHandler, create_handler
from tests.wait import wait_until

Make = Callable[..., EfdlRendezvousHandler]


@pytest.fixture()
def make(etcd_server: EmbeddedEtcd) -> Iterator[Make]:
    job = f"tr-{uuid.uuid4().hex[:8]}"
    made: list[EfdlRendezvousHandler] = []

    def new(
        node: str, min_nodes: int = 1, max_nodes: int = 3, **conf: str
    ) -> EfdlRendezvousHandler:
        params = RendezvousParameters(
            "efdl",
            etcd_server.endpoint.target,
            job,
            min_nodes,
            max_nodes,
            local_addr="127.0.0.1",
            **{
                "node_id": node,
                "last_call_timeout": "0.3",
                "lease_ttl": "3",
                "timeout": "30",
                **conf,
            },
        )
        h = create_handler(params)
        made.append(h)
        return h

    yield new
    for h in made:
        h.shutdown()


def together(*handlers: EfdlRendezvousHandler) -> list[RendezvousInfo]:
    with concurrent.futures.ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def eventually(pred: Callable[[], bool], timeout_s: float = 15) -> None:
    wait_until("the condition", pred, timeout_s)


def test_a_round_gives_ranks_world_size_and_one_shared_store(make: Make) -> None:
    a, b = make("a", min_nodes=2), make("b", min_nodes=2)
    infos = together(a, b)
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boot) == 1 and next(iter(boot))[0] == "127.0.0.1"
    infos[0].store.set("k", b"v")
    assert infos[1].store.get("k") == b"v"
    assert a.get_backend() == "efdl" and a.use_agent_store
    assert a.get_run_id() == b.get_run_id()
    assert a.num_nodes_waiting() == 0 and not a.is_closed()


def test_a_late_node_is_counted_as_waiting_and_admitted_on_re_rendezvous(make: Make) -> None:
    a, b = make("a"), make("b")
    first = together(a, b)
    assert {i.world_size for i in first} == {2}
    c = make("c")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(c.next_rendezvous)
        eventually(lambda: a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1)
        infos = [*together(a, b), late.result(timeout=30)]
    assert {i.world_size for i in infos} == {3}
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert [i.rank for i in infos[:2]] == [i.rank for i in first]  # survivors keep their ranks
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == c.num_nodes_waiting() == 0


def test_next_rendezvous_after_a_restart_makes_a_new_round_for_everyone(make: Make) -> None:
    a, b = make("a"), make("b")
    first = together(a, b)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        again = pool.submit(a.next_rendezvous)  # a's workers failed: torchrun restarts them
        eventually(lambda: b.num_nodes_waiting() > 0)  # b is told to restart too
        b_info = b.next_rendezvous()  # the round starts when both have arrived
        second = [again.result(timeout=30), b_info]
    assert [i.rank for i in second] == [i.rank for i in first]
    assert {i.world_size for i in second} == {2}
    assert a._returned is not None and a._returned.generation > 1
    # A fresh store per round: nothing of the first round is left in it.
    first[0].store.set("old", b"1")
    assert not second[1].store.check(["old"])


def test_closing_is_seen_by_every_node_and_ends_the_rendezvous(make: Make) -> None:
    a, b = make("a"), make("b")
    together(a, b)
    a.set_closed()
    assert a.is_closed() and b.is_closed()
    with pytest.raises(SystemExit) as ended:  # a member of the ended job: done, exit 0
        b.next_rendezvous()
    assert ended.value.code == 0
    with pytest.raises(RendezvousClosedError, match="has ended"):  # a node that comes late
        make("c").next_rendezvous()


def test_below_min_for_longer_than_the_timeout_is_a_timeout(make: Make) -> None:
    a = make("a", min_nodes=2, timeout="2")
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        a.next_rendezvous()
    assert time.monotonic() - t0 < 15


def test_shutdown_leaves_and_the_others_go_on_without_it(make: Make) -> None:
    a, b = make("a"), make("b")
    together(a, b)
    assert b.shutdown()
    eventually(lambda: a.num_nodes_waiting() > 0)  # a new round without b
    info = a.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("conf", "message"),
    [({"lease_ttl": "soon"}, "lease_ttl='soon'"), ({"timeout": "-1"}, "timeout='-1'")],
)
def test_bad_rdzv_conf_values_are_named(make: Make, conf: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make("a", **conf)


def test_torch_finds_the_handler_by_its_backend_name(etcd_server: EmbeddedEtcd) -> None:
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        "efdl",
        etcd_server.endpoint.target,
        f"tr-{uuid.uuid4().hex[:8]}",
        1,
        1,
        local_addr="127.0.0.1",
    )
    h = get_rendezvous_handler(params)
    try:
        assert isinstance(h, EfdlRendezvousHandler)
    finally:
        h.shutdown()
