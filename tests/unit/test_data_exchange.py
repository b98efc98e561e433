"""efdl.data.exchange: DataLoader workers' windows through shared-memory files, between
real processes' views of one directory (two Exchange objects stand for two workers)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from efdl.data import exchange
from efdl.data.exchange import Exchange, SharedDirectoryError, sweep, token
from efdl.data.source import DataSourceError, ParquetSource, ReaderSource
from efdl.data.tar import TarSource


def arrow() -> ParquetSource:
    """A source of Arrow pieces (its file is never read here)."""
    return ParquetSource(["never-read.parquet"], rows=[1])


@pytest.fixture
def stream_token() -> Iterator[str]:
    made = token()
    yield made
    sweep(made)


def test_a_window_goes_to_each_taker_once_and_then_its_name_is_gone(stream_token: str) -> None:
    source = arrow()
    owner, taker = (Exchange(source, stream_token, "it", w, 3) for w in (0, 1))
    table = pa.table({"id": pa.array(range(1000)), "s": pa.array([str(i) for i in range(1000)])})
    owner.give(4, 7, table, takers={0, 1, 2})  # not to itself
    names = sorted(p.name for p in owner.root.iterdir() if p.name[0].isdigit())
    assert names == ["4-7.1", "4-7.2"]
    assert taker.take(4, 7, owner=0).equals(table)
    taker.release(4, 7)
    assert not (owner.root / "4-7.1").exists()
    assert (owner.root / "4-7.2").exists()  # worker 2's, until it takes it
    owner.close(finished=True)
    taker.close(finished=True)
    assert (owner.root / "4-7.2").exists()  # worker 2 has not begun: its window waits for it
    late = Exchange(source, stream_token, "it", 2, 3)
    assert late.take(4, 7, owner=0).equals(table)
    late.release(4, 7)
    late.close(finished=True)
    assert not owner.root.exists()  # the last of the loader's workers took it along


def test_a_worker_that_begins_after_the_others_closed_finds_their_windows(
    stream_token: str,
) -> None:
    """A worker slow to start (its first batch is the last asked for): the others may read
    and give all they had to and close before it begins (near an epoch's end, an
    iteration's steps are few). Their windows wait for it."""
    source = arrow()
    table = pa.table({"id": pa.array(range(10))})
    owner = Exchange(source, stream_token, "it", 0, 2)
    owner.give(3, 1, table, takers={1})
    owner.close(finished=True)
    late = Exchange(source, stream_token, "it", 1, 2, wait_s=30)
    assert late.take(3, 1, owner=0).equals(table)
    late.release(3, 1)
    late.close(finished=True)
    assert not late.root.exists()


def test_a_worker_closes_cleanly_where_its_directory_was_removed(stream_token: str) -> None:
    """Another iteration over the same stream swept it: nothing is left to tidy, and the
    iteration's end (or its error) is not replaced by a FileNotFoundError."""
    source = arrow()
    a = Exchange(source, stream_token, "it", 0, 2)
    a.give(0, 0, pa.table({"id": [1]}), takers={1})
    sweep(stream_token)
    a.close(finished=False, error="its own error")
    assert not a.root.exists()


def test_a_window_its_owner_finished_without_is_an_error_at_once(stream_token: str) -> None:
    """An owner that closed having given all it had to: a window not there will not come.
    The taker says so, rather than wait out ``wait_s`` (which bounds an owner stuck on a
    read)."""
    source = arrow()
    owner = Exchange(source, stream_token, "it", 0, 2)
    taker = Exchange(source, stream_token, "it", 1, 2, wait_s=600)
    owner.close(finished=True)
    with pytest.raises(DataSourceError, match=r"worker 0 of 2 finished .* without window 5"):
        taker.take(5, 2, owner=0)
    taker.close(finished=True)


def pool(exchange: Exchange) -> list[str]:
    return sorted(p.name for p in exchange.root.glob(f"pool.{exchange.worker}.*"))


def test_a_file_is_written_again_once_every_taker_released_it(stream_token: str) -> None:
    """The owner's pool: a window goes into a file whose names are all gone, else into a
    new one; a taker maps each file once, again only when it grew."""
    source = arrow()
    owner, one, two = (Exchange(source, stream_token, "it", w, 3) for w in (0, 1, 2))
    windows = [pa.table({"id": pa.array(range(k, k + 100))}) for k in range(0, 300, 100)]
    owner.give(0, 0, windows[0], takers={1, 2})
    assert one.take(0, 0, owner=0).equals(windows[0])
    one.release(0, 0)
    owner.give(1, 0, windows[1], takers={1, 2})  # worker 2 still has window 0: a new file
    assert len(pool(owner)) == 2
    assert two.take(0, 0, owner=0).equals(windows[0])
    two.release(0, 0)
    owner.give(2, 0, windows[2], takers={1, 2})  # into the first file again
    assert len(pool(owner)) == 2
    assert one.take(2, 0, owner=0).equals(windows[2])
    assert one.take(1, 0, owner=0).equals(windows[1])
    assert len(one._maps) == 2  # two files, each mapped once
    bigger = pa.table({"id": pa.array(range(5000))})
    one.release(1, 0)
    one.release(2, 0)
    assert two.take(1, 0, owner=0).equals(windows[1])
    assert two.take(2, 0, owner=0).equals(windows[2])
    two.release(1, 0)
    two.release(2, 0)
    owner.give(3, 0, bigger, takers={1})  # grows a file: mapped again, whole
    assert one.take(3, 0, owner=0).equals(bigger)
    for side in (owner, one, two):
        side.close(finished=True)


def test_lists_of_samples_go_too(stream_token: str) -> None:
    source = ReaderSource(["a"], lambda shard, start: iter(()), [2])
    owner, taker = (Exchange(source, stream_token, "it", w, 2) for w in (0, 1))
    owner.give(0, 0, [{"id": 1}, {"id": 2}], takers={1})
    assert taker.take(0, 0, owner=0) == [{"id": 1}, {"id": 2}]
    taker.release(0, 0)
    owner.give(1, 0, [{"id": 3}], takers={1})  # over the longer pickle: its end is ignored
    assert taker.take(1, 0, owner=0) == [{"id": 3}]
    assert len(pool(owner)) == 1


def test_a_wait_ends_at_its_deadline_or_when_the_owner_left(stream_token: str) -> None:
    source = arrow()
    owner = Exchange(source, stream_token, "it", 0, 2)
    taker = Exchange(source, stream_token, "it", 1, 2, wait_s=0.2)
    with pytest.raises(DataSourceError, match="worker 0 of 2 did not give window 3 of lane 5"):
        taker.take(3, 5, owner=0)
    taker.wait_s = 60
    owner.close(finished=False, error="DataSourceError: 'x.parquet' has 10 rows")
    with pytest.raises(DataSourceError, match=r"worker 0 left .* 'x\.parquet' has 10 rows"):
        taker.take(3, 5, owner=0)


def test_a_mark_of_an_earlier_iteration_of_the_same_name_is_not_a_leave(
    stream_token: str,
) -> None:
    source = arrow()
    first, _ = (Exchange(source, stream_token, "it", w, 2) for w in (0, 1))
    first.close(finished=False)  # worker 1 is still in: the directory and the mark stay
    assert first.left() == (0, "")
    later = Exchange(source, stream_token, "it", 1, 2, wait_s=0.3)
    # Where the files' clock is coarse, the later start may share the mark's time: the same
    # time counts as earlier.
    assert later.left() is None
    with pytest.raises(DataSourceError, match="did not give"):
        later.take(0, 0, owner=0)


def test_sweep_takes_this_streams_and_dead_processes_old_directories(stream_token: str) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    root = exchange.base()
    mine = root / f"efdl-stream-{stream_token}-1"
    dead_old = root / f"efdl-stream-{done.pid}-0000-1"
    dead_new = root / f"efdl-stream-{done.pid}-0001-1"
    alive = root / f"efdl-stream-{os.getpid()}-ffff-1"
    try:
        for folder in (mine, dead_old, dead_new, alive):
            folder.mkdir()
        old = time.time() - exchange._STALE_S - 60
        os.utime(dead_old, (old, old))
        sweep(stream_token)
        assert [f.exists() for f in (mine, dead_old, dead_new, alive)] == [0, 0, 1, 1]
    finally:
        for folder in (dead_new, alive):
            folder.rmdir()


@pytest.mark.parametrize("finished", [True, False])
def test_the_directory_goes_with_its_last_worker(stream_token: str, finished: bool) -> None:
    source = arrow()
    a, b = (Exchange(source, stream_token, "it", w, 2) for w in (0, 1))
    a.give(0, 0, pa.table({"id": [1]}), takers={1})
    a.give(1, 0, pa.table({"id": [2]}), takers={1})  # never taken
    b.take(0, 0, owner=0)
    a.close(finished)
    assert a.root.exists()
    b.close(finished)
    assert not a.root.exists()


def test_the_windows_go_where_efdl_data_shm_says(
    stream_token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EFDL_DATA_SHM", str(tmp_path))
    made = Exchange(arrow(), stream_token, "it", 0, 2)
    assert made.root.parent == tmp_path


def test_no_room_for_a_window_is_a_clear_error(
    stream_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    owner = Exchange(arrow(), stream_token, "it", 0, 2)
    with monkeypatch.context() as patched:
        patched.setattr(exchange, "_allocate", full)
        with pytest.raises(DataSourceError, match=r"No space left.*EFDL_DATA_SHM"):
            owner.give(0, 0, pa.table({"id": [1]}), takers={1})
    assert not any(p.name.startswith("0-0") for p in owner.root.iterdir())
    owner.give(0, 0, pa.table({"id": [1]}), takers={1})  # with room, the same file serves
    assert len(pool(owner)) == 1
    assert (owner.root / "0-0.1").exists()


def test_a_window_given_while_the_worker_closes_is_dropped(stream_token: str) -> None:
    """A reader thread gives while the consumer thread closes the exchange (the loop ended):
    the window goes nowhere, with no error and no file left behind."""

    class Closing(ParquetSource):
        def dump(self, piece: object, room: object) -> None:
            owner.close(finished=False)  # between choosing a file and writing it
            super().dump(piece, room)  # type: ignore[arg-type]

    owner = Exchange(Closing(["never-read.parquet"], rows=[1]), stream_token, "it", 0, 2)
    other = Exchange(arrow(), stream_token, "it", 1, 2)
    owner.give(0, 0, pa.table({"id": [1]}), takers={1})
    assert sorted(p.name for p in owner.root.iterdir()) == [
        "begun.0",
        "begun.1",
        "closed.0",
        "left.0",
    ]
    other.close(finished=True)
    assert not owner.root.exists()


ROOT = os.geteuid() == 0
OTHER_UID = 65534  # nobody


def test_the_windows_directory_is_this_users_alone(stream_token: str) -> None:
    """Mode 0700 whatever the umask (one that leaves others read and search, the common
    0022, and one that takes the owner's write, which the mode is made again after)."""
    for umask in (0o022, 0o277):
        before = os.umask(umask)
        try:
            made = Exchange(arrow(), stream_token, f"it{umask}", 0, 2)
        finally:
            os.umask(before)
        info = os.lstat(made.root)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        made.close(finished=True)


def someone_elses(path: Path, kind: str, elsewhere: Path) -> str:
    """Make at ``path`` what another local user could have put there before the worker;
    returns what the refusal says it found."""
    if kind == "open to all":
        path.mkdir()
        path.chmod(0o777)
        return r"a directory owned by uid \d+ with mode 0o777"
    if kind == "a link":
        path.symlink_to(elsewhere, target_is_directory=True)
        return r"a symbolic link owned by uid \d+"
    if kind == "a file":
        path.write_bytes(b"")
        return "a regular file"
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, OTHER_UID)
    return f"a directory owned by uid {OTHER_UID} with mode 0o700"


@pytest.mark.parametrize(
    "kind",
    [
        "open to all",
        "a link",
        "a file",
        pytest.param(
            "another user's",
            marks=pytest.mark.skipif(not ROOT, reason="giving a directory away takes root"),
        ),
    ],
)
def test_a_directory_someone_else_made_is_refused(
    stream_token: str, tmp_path: Path, kind: str
) -> None:
    """Another local user who makes the iteration's directory first (its name shows in
    /dev/shm) could feed the workers windows or read theirs: the worker refuses it, naming
    it, what it found and what it expected, and writes nothing there (nor where a link
    points)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = exchange.base() / f"efdl-stream-{stream_token}-it"
    try:
        found = someone_elses(path, kind, elsewhere)
        with pytest.raises(SharedDirectoryError) as refused:
            Exchange(arrow(), stream_token, "it", 0, 2)
        said = str(refused.value)
        assert str(path) in said and re.search(found, said), said
        assert "expected a directory (not a symbolic link) of this user" in said
        assert f"(uid {os.geteuid()}) with mode 0o700" in said
        assert isinstance(refused.value, PermissionError)
        assert not list(elsewhere.iterdir())
        if path.is_dir() and not path.is_symlink():
            assert not list(path.iterdir())
    finally:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)


class Planted:
    """What another user would put in a window: unpickled, it makes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def plant(taker: Exchange, j: int, lane: int, marker: Path, mode: int = 0o600) -> Path:
    window = taker.root / f"{j}-{lane}.{taker.worker}"
    window.write_bytes(pickle.dumps([Planted(marker)], protocol=pickle.HIGHEST_PROTOCOL))
    window.chmod(mode)
    return window


def test_tar_windows_are_read_without_running_code(stream_token: str, tmp_path: Path) -> None:
    """Tar samples are dicts of strings and bytes: their windows load as data only, so a
    pickle that would run code is refused, and does not run."""
    source = TarSource(["never-read.tar"], rows=[2])
    owner, taker = (Exchange(source, stream_token, "it", w, 2) for w in (0, 1))
    samples = [{"__key__": "a/0", "jpg": b"\xff" * 70_000, "cls": b"1"}, {"__key__": "a/1"}]
    owner.give(0, 0, samples, takers={1})
    assert taker.take(0, 0, owner=0) == samples
    marker = tmp_path / "ran"
    plant(taker, 1, 0, marker)
    with pytest.raises(DataSourceError, match=r"names posix\.mkdir; expected plain data only"):
        taker.take(1, 0, owner=0)
    assert not marker.exists()
    for side in (owner, taker):
        side.close(finished=True)


@pytest.mark.parametrize(
    "kind",
    [
        "writable by others",
        "a link",
        pytest.param(
            "another user's",
            marks=pytest.mark.skipif(not ROOT, reason="giving a file away takes root"),
        ),
    ],
)
def test_a_window_another_user_could_have_written_is_not_read(
    stream_token: str, tmp_path: Path, kind: str
) -> None:
    """A reader function's samples are unpickled (they may be of any class): only from a
    regular file of this user that no other can write, opened without following a link."""
    source = ReaderSource(["a"], lambda shard, start: iter(()), [2])
    taker = Exchange(source, stream_token, "it", 1, 2)
    marker = tmp_path / "ran"
    if kind == "a link":
        planted = tmp_path / "elsewhere"
        planted.write_bytes(pickle.dumps([Planted(marker)], protocol=pickle.HIGHEST_PROTOCOL))
        planted.chmod(0o600)
        (taker.root / "0-0.1").symlink_to(planted)
        found = "not a symbolic link"
    elif kind == "writable by others":
        plant(taker, 0, 0, marker, mode=0o666)
        found = "a regular file owned by uid \\d+ with mode 0o666"
    else:
        os.chown(plant(taker, 0, 0, marker), OTHER_UID, OTHER_UID)
        found = f"a regular file owned by uid {OTHER_UID} with mode 0o600"
    with pytest.raises(SharedDirectoryError, match=found):
        taker.take(0, 0, owner=0)
    assert not marker.exists()
    taker.close(finished=True)


def test_sweep_leaves_what_is_not_this_users_directory(stream_token: str, tmp_path: Path) -> None:
    """A link named as this stream's (to a directory of this user's) is neither followed
    nor removed by the sweep; nor is another user's directory (as root: given away)."""
    target = tmp_path / "kept"
    target.mkdir()
    (target / "file").write_text("x")
    link = exchange.base() / f"efdl-stream-{stream_token}-link"
    theirs = exchange.base() / f"efdl-stream-{stream_token}-theirs"
    try:
        link.symlink_to(target, target_is_directory=True)
        if ROOT:
            theirs.mkdir()
            os.chown(theirs, OTHER_UID, OTHER_UID)
        sweep(stream_token)
        assert link.is_symlink() and (target / "file").exists()
        assert theirs.exists() == ROOT
    finally:
        link.unlink(missing_ok=True)
        if theirs.exists():
            theirs.rmdir()
