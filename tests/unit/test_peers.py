"""Peer copies (efdl.worker.peers): the partner placement, the bounded store, the servers and
the file system over them, and a snapshot written and read back through it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from efdl.errors import ConfigError
from efdl.worker.cache import CacheSettings, FileInfo, SnapshotStorage
from efdl.worker.peers import (
    URL,
    Peer,
    PeerCopies,
    PeerFileSystem,
    PeerStorage,
    Server,
    Store,
    partners,
)
from efdl.worker.persist import Persister


def test_a_partner_is_on_the_next_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    got = partners(nodes)
    assert got == [2, 3, 4, 5, 0, 1]
    assert all(nodes[p] != nodes[r] for r, p in enumerate(got))


def test_uneven_nodes_share_the_copies_round_robin() -> None:
    nodes = ["a", "a", "a", "b"]
    assert partners(nodes) == [3, 3, 3, 0]  # b's one rank keeps all of a's
    assert partners(["ip-10-0-1-17.ec2.internal", "ip-10-0-9-3.ec2.internal"]) == [1, 0]


def test_on_one_node_the_partner_is_the_next_rank() -> None:
    assert partners(["a", "a", "a"]) == [1, 2, 0]
    assert partners(["a"]) == [0]  # alone: nobody else


def test_a_store_keeps_its_newest_step_directories() -> None:
    store = Store(max_steps=2)
    for step in range(1, 5):
        store.put(f"copies/step-{step:012d}/part-00000.pt", b"x" * step)
    assert store.children("copies") == [
        "copies/step-000000000003",
        "copies/step-000000000004",
    ]
    assert store.nbytes == 7
    store.remove("copies/step-000000000003")
    assert store.children("copies") == ["copies/step-000000000004"]


@pytest.fixture()
def two() -> Iterator[tuple[list[Server], list[PeerFileSystem]]]:
    """Two ranks on two nodes, each its store, server and file system."""
    servers = [Server(Store(), "127.0.0.1") for _ in range(2)]
    peers = [
        Peer(r, f"node-{r}", s.host, s.port, s.token) for r, s in enumerate(servers)
    ]
    systems = [PeerFileSystem(s.store, timeout_s=10) for s in servers]
    for r, fs in enumerate(systems):
        fs.place(peers, r)
    yield servers, systems
    for s in servers:
        s.close()


def test_a_file_is_kept_by_its_writer_and_its_partner(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    servers, (fs0, fs1) = two
    fs0.pipe_file("copies/step-000000000001/part-00000.pt", b"rows of rank 0")
    for s in servers:
        assert s.store.get("copies/step-000000000001/part-00000.pt") == b"rows of rank 0"
    servers[0].store.remove("copies")  # rank 0's memory gone: its partner's copy is read
    assert fs0.cat_file("copies/step-000000000001/part-00000.pt") == b"rows of rank 0"
    with fs1.open("copies/step-000000000001/rank-00001.pt", "wb") as f:
        f.write(b"rank 1")
    assert fs0.ls("copies/step-000000000001") == [
        "copies/step-000000000001/part-00000.pt",
        "copies/step-000000000001/rank-00001.pt",
    ]
    fs0.rm("copies/step-000000000001", recursive=True)
    assert fs1.ls("copies") == [] and servers[1].store.nbytes == 0
    with pytest.raises(FileNotFoundError):
        fs1.cat_file("copies/step-000000000001/part-00000.pt")


def test_a_request_without_the_token_is_refused(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    servers, (fs0, _) = two
    fs0.pipe_file("copies/secret.pt", b"rows")
    stranger = PeerFileSystem(Store(), timeout_s=10)
    s = servers[1]
    wrong = Peer(1, "node-1", s.host, s.port, "0" * 32)
    stranger.place([Peer(0, "node-x", "127.0.0.1", 1, "x"), wrong], 0)
    with pytest.raises(OSError, match="403"):
        stranger.pipe_file("copies/secret.pt", b"forged")
    assert s.store.get("copies/secret.pt") == b"rows"
    with pytest.raises(FileNotFoundError):  # its refusal reads as nothing there
        stranger.cat_file("copies/secret.pt")


def test_a_dead_peer_is_skipped_when_reading(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    servers, (_, fs1) = two
    fs1.pipe_file("copies/f", b"one")
    servers[0].close()  # rank 0's node died; rank 1 still reads and lists its own
    assert fs1.cat_file("copies/f") == b"one"
    assert fs1.ls("copies") == ["copies/f"]


def test_a_snapshot_written_through_the_peers_reads_back_whole(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    servers, (fs0, fs1) = two
    storage = SnapshotStorage(URL, fs=fs0)
    writer = Persister(CacheSettings(URL, every_steps=1, every_s=0), storage=storage)
    tree = {"model": {"w": torch.arange(12.0)}, "step": 7}
    done: list[int] = []
    writer.start(7, None, 0, 1, tree, set(), {"rng": None}, lambda m: done.append(m.step))
    assert writer.flush(30) and done == [7]
    servers[0].store.remove("copies")  # read from the partner's memory alone
    found = SnapshotStorage(URL, fs=fs1).newest()
    assert found is not None
    manifest, state = found
    assert manifest.step == 7 and torch.equal(state["model"]["w"], torch.arange(12.0))


def test_a_snapshot_missing_a_file_is_not_whole(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    servers, (fs0, fs1) = two
    storage = SnapshotStorage(URL, fs=fs0)
    writer = Persister(CacheSettings(URL, every_steps=1, every_s=0), storage=storage)
    writer.start(3, None, 0, 1, {"model": {"w": torch.ones(4)}}, set(), {}, lambda m: None)
    assert writer.flush(30)
    for s in servers:  # the part's writer and its partner both gone
        for name in s.store.children("copies/step-000000000003"):
            if "part-" in name:
                s.store.remove(name)
    assert SnapshotStorage(URL, fs=fs1).newest_structure() is None


def test_peer_copies_from_the_agent_s_setting() -> None:
    assert PeerCopies.from_env(None, {}) is None
    assert PeerCopies.from_env(None, {"EFDL_PEER_COPIES": "0"}) is None
    with pytest.raises(ConfigError, match="EFDL_PEER_COPIES='often'"):
        PeerCopies.from_env(None, {"EFDL_PEER_COPIES": "often"})
    copies = PeerCopies.from_env(None, {"EFDL_PEER_COPIES": "2", "EFDL_NODE_ID": "a"})
    assert copies is not None
    try:
        assert copies.persister.settings.every_steps == 2 and copies.server.host == "127.0.0.1"
    finally:
        copies.server.close()


def test_reports_reach_rank_0_and_a_listing_says_who_holds_what() -> None:
    """At 1,024 ranks rank 0 must not ask every rank at each look for the reports, nor a
    reader ask rank after rank for a file: reports go to rank 0 as well, and rank 0's
    listing of a snapshot says which ranks hold each file."""
    servers = [Server(Store(), "127.0.0.1") for _ in range(3)]
    try:
        peers = [Peer(r, f"node-{r}", s.host, s.port, s.token) for r, s in enumerate(servers)]
        systems = [PeerFileSystem(s.store, timeout_s=10) for s in servers]
        for r, fs in enumerate(systems):
            fs.place(peers, r)
        step = "copies/step-000000000005"
        systems[1].pipe_file(f"{step}/report-00001.json", b"{}")  # rank 1's partner: rank 2
        systems[1].pipe_file(f"{step}/part-00001.pt", b"rows")
        assert servers[0].store.get(f"{step}/report-00001.json") == b"{}"
        assert servers[0].store.get(f"{step}/part-00001.pt") is None
        assert PeerStorage(systems[0]).reporters(5) == {1}
        systems[0].ls(step)
        holders = PeerStorage(systems[0]).holders(5)
        assert holders[f"{step}/part-00001.pt"] == [1, 2]
        systems[2].know(holders)
        servers[2].store.remove(step)  # rank 2 reads rank 1's part from rank 1, as told
        assert systems[2].cat_file(f"{step}/part-00001.pt") == b"rows"
        systems[0].rm(step, recursive=True)  # a pruned snapshot leaves nothing in the map
        assert PeerStorage(systems[0]).holders(5) == {}
    finally:
        for s in servers:
            s.close()


def test_a_copy_can_be_decided_while_the_one_begun_at_this_commit_is_written() -> None:
    """The agreement carries a decision to the next commit: a peer copy begun at this commit
    has that step to finish, so it neither blocks the next decision nor is counted as
    writing an older one (copies can follow every commit); one begun earlier does."""
    writer = Persister(CacheSettings(URL, every_steps=1, every_s=0), storage=_Slow())
    assert writer.due(4, pipelined=True) and not writer.busy_before(4)
    writer.start(4, None, 1, 2, {"model": {"w": torch.ones(2)}}, set(), {}, lambda m: None)
    try:
        assert writer.busy and not writer.due(4)  # the remote cache's rule: one at a time
        assert writer.due(4, pipelined=True) and not writer.busy_before(4)
        assert writer.busy_before(5) and not writer.due(5, pipelined=True)
    finally:
        _Slow.gate.set()
        assert writer.flush(30)


class _Slow(SnapshotStorage):
    """A storage whose writes wait for the test."""

    gate = threading.Event()

    def __init__(self) -> None:
        super().__init__("memory://efdl-slow")

    def write(self, step: int, name: str, obj: object, sync: bool = True) -> FileInfo:
        self.gate.wait(30)
        return FileInfo(0, "0" * 32)

    def report(self, step: int, rank: int, files: object, attempt: int) -> None:
        pass


def test_a_damaged_copy_gives_way_to_another_holder_s(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    """A copy in the reader's own memory that is not what the manifest says (left by an
    earlier attempt at the same step, or damaged) must not hide its partner's good one."""
    servers, (fs0, _) = two
    storage = PeerStorage(fs0)
    writer = Persister(CacheSettings(URL, every_steps=1, every_s=0), storage=storage)
    writer.start(2, None, 0, 1, {"model": {"w": torch.arange(8.0)}}, set(), {}, lambda m: None)
    assert writer.flush(30)
    for name in servers[0].store.children("copies/step-000000000002"):
        if "part-" in name:
            data = servers[0].store.get(name)
            assert data is not None
            servers[0].store.put(name, bytes(len(data)))  # rank 0's own copy: zeros
    found = storage.newest()
    assert found is not None and torch.equal(found[1]["model"]["w"], torch.arange(8.0))


def test_a_server_refuses_a_file_without_a_sane_length(
    two: tuple[list[Server], list[PeerFileSystem]],
) -> None:
    import http.client

    servers, _ = two
    s = servers[0]
    for length in ("-1", "nonsense", str(1 << 40)):
        conn = http.client.HTTPConnection(s.host, s.port, timeout=10)
        conn.putrequest("PUT", "/files/copies/x")
        conn.putheader("X-Efdl-Token", s.token)
        conn.putheader("Content-Length", length)
        conn.endheaders()
        assert conn.getresponse().status == 400
        conn.close()
    assert s.store.get("copies/x") is None
