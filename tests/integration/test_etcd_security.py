"""TLS with client certificates and user/password auth against a real etcd."""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2
from etcd3.utils import prefix_range_end

from efdl.errors import StoreAuthError, StoreConnectionError, StoreError
from efdl.rendezvous.embedded import EmbeddedEtcd, ServerTls
from efdl.rendezvous.etcd_store import EtcdStore


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    san_ip: bool = False,
    ca: bool = False,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer if issuer else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san_ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("efdl test CA", ca_key, None, ca=True)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("some other CA", other_key, None, ca=True)
    paths = {}
    for who, san in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"efdl {who}", key, (ca.subject, ca_key), san_ip=san)
        (d / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, d / f"{who}-key.pem")
        paths[who] = (d / f"{who}.pem", d / f"{who}-key.pem")
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "other-ca.pem").write_bytes(other.public_bytes(serialization.Encoding.PEM))
    return Pki(d / "ca.pem", *paths["server"], *paths["client"], d / "other-ca.pem")


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki) -> Iterator[EmbeddedEtcd]:
    tls = ServerTls(pki.server_cert, pki.server_key, client_ca=pki.ca)
    with EmbeddedEtcd(tls=tls) as server:
        yield server


def test_tls_with_client_certificate(tls_etcd: EmbeddedEtcd, pki: Pki) -> None:
    settings = tls_etcd.settings(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    with EtcdStore(settings) as store:
        store.put("/tls/k", b"secret")
        kv = store.get("/tls/k")
        assert kv is not None and kv.value == b"secret"
    assert str(tls_etcd.endpoint).startswith("https://127.0.0.1:")


def test_tls_without_client_certificate_is_refused(tls_etcd: EmbeddedEtcd, pki: Pki) -> None:
    settings = tls_etcd.settings(ca_file=pki.ca, connect_timeout_s=2)
    with pytest.raises(StoreConnectionError) as info:
        EtcdStore(settings)
    assert str(tls_etcd.endpoint.port) in str(info.value)


def test_tls_with_the_wrong_ca_is_refused(tls_etcd: EmbeddedEtcd, pki: Pki) -> None:
    settings = tls_etcd.settings(
        ca_file=pki.other_ca,
        cert_file=pki.client_cert,
        key_file=pki.client_key,
        connect_timeout_s=2,
    )
    with pytest.raises(StoreConnectionError) as info:
        EtcdStore(settings)
    assert "CA file" in str(info.value)


def _enable_auth(server: EmbeddedEtcd, root_password: str) -> None:
    """Users root and alice (read-write on /efdl/job-a/ only), then auth on: etcdctl's steps."""
    channel = grpc.insecure_channel(server.endpoint.target)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="job-a"))
    prefix = b"/efdl/job-a/"
    auth.RoleGrantPermission(
        etcdrpc.AuthRoleGrantPermissionRequest(
            name="job-a",
            perm=auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE,
                key=prefix,
                range_end=prefix_range_end(prefix),
            ),
        )
    )
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="alice", password="alice-pw"))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="alice", role="job-a"))
    auth.AuthEnable(etcdrpc.AuthEnableRequest())
    channel.close()


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EmbeddedEtcd]:
    # Tokens expire after 2 s here, so the tests see the client renew them.
    with EmbeddedEtcd(extra_args=("--auth-token=simple", "--auth-token-ttl=2")) as server:
        _enable_auth(server, "root-pw")
        yield server


def test_auth_with_the_right_password(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(auth_etcd.settings(user="root", password="root-pw")) as store:
        store.put("/efdl/any/k", b"v")
        assert store.get("/efdl/any/k") is not None


def test_wrong_password_is_a_clear_error(auth_etcd: EmbeddedEtcd) -> None:
    with pytest.raises(StoreAuthError) as info:
        EtcdStore(auth_etcd.settings(user="root", password="nope"))
    message = str(info.value)
    assert "'root'" in message and str(auth_etcd.endpoint) in message
    assert "nope" not in message


def test_no_credentials_on_an_auth_cluster_is_refused(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(auth_etcd.settings()) as store, pytest.raises(StoreAuthError):
        store.put("/efdl/job-a/k", b"v")


def test_a_role_limited_to_its_job_prefix(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(auth_etcd.settings(user="alice", password="alice-pw")) as store:
        store.put("/efdl/job-a/nodes/n1", b"ok")
        with pytest.raises(StoreAuthError) as info:
            store.put("/efdl/job-b/nodes/n1", b"no")
        assert "'alice'" in str(info.value)
        with pytest.raises(StoreError):
            store.get_prefix("/efdl/")


def test_an_expired_token_is_renewed(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdStore(auth_etcd.settings(user="alice", password="alice-pw")) as store:
        store.put("/efdl/job-a/k", b"1")
        start = store.get_prefix("/efdl/job-a/").revision + 1
        watch = store.watch("/efdl/job-a/", prefix=True, start_revision=start)
        time.sleep(4)  # two token TTLs
        store.put("/efdl/job-a/k", b"2")
        kv = store.get("/efdl/job-a/k")
        assert kv is not None and kv.value == b"2"
        batch = watch.get(timeout_s=10)
        watch.cancel()
    assert batch is not None and batch.events[0].kv.value == b"2"
