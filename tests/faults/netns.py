"""Two network namespaces of the test's own, joined by a veth pair, to cut one node off.

``main`` holds etcd and the nodes that stay connected; ``cut`` holds the node to partition.
Their addresses (10.231.X.1 and .2) exist only inside these namespaces: nothing outside them
is reachable or reached. Partition: the cut side's link goes down (no RST, no FIN: packets
just stop, as when a switch port dies); heal: it comes back up.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from efdl._process import free_port
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.embedded import EmbeddedEtcd, EtcdCluster


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def available() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"efdl-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return str(exc)
    _ip("netns", "del", probe)
    return None


class Net:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.main, self.cut = f"efdl-{tag}-m", f"efdl-{tag}-c"
        self._veth_main, self._veth_cut = f"vm{tag}", f"vc{tag}"
        subnet = random.randint(1, 254)
        self.main_addr, self.cut_addr = f"10.231.{subnet}.1", f"10.231.{subnet}.2"

    def up(self) -> Net:
        for ns in (self.main, self.cut):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip(
            "link", "add", self._veth_main, "netns", self.main, "type", "veth",
            "peer", "name", self._veth_cut, "netns", self.cut,
        )  # fmt: skip
        _ip("-n", self.main, "addr", "add", f"{self.main_addr}/24", "dev", self._veth_main)
        _ip("-n", self.cut, "addr", "add", f"{self.cut_addr}/24", "dev", self._veth_cut)
        _ip("-n", self.main, "link", "set", self._veth_main, "up")
        _ip("-n", self.cut, "link", "set", self._veth_cut, "up")
        return self

    @staticmethod
    def exec(ns: str) -> tuple[str, ...]:
        """A command prefix that runs in ``ns`` (``ip netns exec`` execs: the PID is kept)."""
        return ("ip", "netns", "exec", ns)

    def partition(self) -> None:
        _ip("-n", self.cut, "link", "set", self._veth_cut, "down")

    def heal(self) -> None:
        _ip("-n", self.cut, "link", "set", self._veth_cut, "up")

    def down(self) -> None:
        for ns in (self.main, self.cut):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


class NetnsEtcd(EmbeddedEtcd):
    """The embedded etcd, run inside a namespace on that namespace's address."""

    def __init__(self, ns: str, address: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ns, self._address = ns, address

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self._address, self.client_port)

    def _command(self) -> list[str]:
        cmd = [c.replace("127.0.0.1", self._address) for c in super()._command()]
        return [*Net.exec(self._ns), *cmd]

    def _wait_started(self) -> bool:
        """Ask from inside the namespace (the test process cannot reach its address)."""
        assert self._proc is not None
        probe = (
            "import urllib.request; "
            f"urllib.request.urlopen('http://{self._address}:{self.client_port}/health', "
            "timeout=1).read()"
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            done = subprocess.run(
                [*Net.exec(self._ns), sys.executable, "-c", probe],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if done.returncode == 0:
                return True
            time.sleep(0.2)
        return False


class NetnsCluster(EtcdCluster):
    """A 3-member etcd with member m0 alone in ``net.cut`` and m1, m2 in ``net.main``: a
    partition cuts m0 off from its peers and from every client in ``net.main`` (it loses the
    quorum; the others keep it)."""

    def __init__(self, net: Net) -> None:
        places = [(net.cut, net.cut_addr), (net.main, net.main_addr), (net.main, net.main_addr)]
        ports = [(free_port(), free_port()) for _ in places]
        initial = ",".join(
            f"m{i}=http://{addr}:{peer}"
            for i, ((_, addr), (_, peer)) in enumerate(zip(places, ports, strict=True))
        )
        self.members = []
        for i, ((ns, addr), (client, peer)) in enumerate(zip(places, ports, strict=True)):
            member = NetnsEtcd(ns, addr, name=f"m{i}", cluster=initial)
            member.client_port, member.peer_port = client, peer
            self.members.append(member)


def run_in(ns: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*Net.exec(ns), *argv], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )
