"""Credentials in clear: which etcd endpoints a password (or job token) would reach over
plain http from this host, and the warning that says so once per process."""

from __future__ import annotations

import ipaddress
import logging
import threading

from efdl.rendezvous.api import Endpoint, EtcdSettings

log = logging.getLogger(__name__)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP, or ``localhost``) is reachable from this host alone; a
    name other than ``localhost`` is taken for reachable from others."""
    text = address.strip("[]")
    if text == "localhost":
        return True
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def plaintext_endpoints(settings: EtcdSettings) -> tuple[Endpoint, ...]:
    """The endpoints a password (or job token) would reach in clear: none without one or
    with TLS; else every endpoint not on loopback, whose traffic never leaves the host. Pure."""
    if settings.password is None or settings.tls:
        return ()
    return tuple(e for e in settings.endpoints if not is_loopback(e.host))


_warned_plaintext: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_plaintext(settings: EtcdSettings) -> bool:
    """Log a warning, once per process for these endpoints and user, when credentials go to
    etcd over plain http (see :func:`plaintext_endpoints`); whether it did now."""
    exposed = plaintext_endpoints(settings)
    if not exposed:
        return False
    key = (settings.endpoint_list, settings.user or "")
    with _warned_lock:
        if key in _warned_plaintext:
            return False
        _warned_plaintext.add(key)
    log.warning(
        "etcd credentials (user %r and its password, or the job token) go over plain http "
        "to %s: whoever can watch that network can read them, and with them stop the job, "
        "join it and be sent its model state. Give etcd TLS (https:// endpoints and "
        "--etcd-ca), or keep it on this host.",
        settings.user,
        ", ".join(str(e) for e in exposed),
    )
    return True
