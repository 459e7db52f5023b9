"""Where a completion webhook may go (issue 34, finding 7: listing ``localhost`` let a notify URL
post to the broker's own port and to Redis's): allow-list entries carry ports (80 and 443 when
they name none), and a per-turn URL never reaches a loopback, private, link-local or other
non-public address, before or after its name is resolved, unless the operator says so."""

from __future__ import annotations

import base64
import ipaddress
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.embedded_redis import find_server_binary
from broker.settings import Settings, SettingsError
from broker.webhook_config import (
    HostEntry,
    WebhookConfig,
    WebhookConfigError,
    address_kind,
    parse_entry,
)
from tests.conftest import BrokerFactory, free_port
from tests.helpers import wait_final, wait_until
from tests.test_webhooks import FAST, GAVE_UP, RETRIED, Receiver, post_turn, receivers

__all__ = ["receivers"]  # the fixture, used here as in test_webhooks

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
ADDRESS_REFUSED = 'broker_webhook_refusals_total{reason="address"}'


@pytest.fixture
def tcp_redis() -> Iterator[int]:
    """A Redis server listening on a loopback TCP port, as an operator's would: its port."""
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            [
                find_server_binary(),
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: _answers(port))
            yield port
        finally:
            process.terminate()
            process.wait(timeout=10)


def _answers(port: int) -> bool:
    client = redis.Redis(port=port)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def connections_received(port: int) -> int:
    """The connections a Redis server has accepted so far (this look's own included)."""
    client = redis.Redis(port=port)
    try:
        return int(client.info("stats")["total_connections_received"])
    finally:
        client.close()


def test_listing_localhost_reaches_neither_the_brokers_port_nor_redis(
    broker_factory: BrokerFactory, tcp_redis: int
) -> None:
    broker = broker_factory(**FAST, webhook_hosts="localhost")
    broker_port = urllib.parse.urlsplit(broker.base_url).port
    before = connections_received(tcp_redis)
    for url in (
        f"http://localhost:{broker_port}/v1/turns",
        f"http://localhost:{tcp_redis}/",
        f"http://127.0.0.1:{tcp_redis}/",
    ):
        response = post_turn(broker, "ssrf-1", {"url": url})
        assert response.status_code == 422, (url, response.text)
        assert response.json()["error"]["code"] == "notify_not_allowed"
    # Listed with its port, loopback is still not reached: listing the name is not enough.
    port_listed = broker_factory(**FAST, webhook_hosts=f"localhost:{tcp_redis}")
    response = post_turn(port_listed, "ssrf-2", {"url": f"http://localhost:{tcp_redis}/"})
    assert response.status_code == 422, response.text
    assert "loopback" in response.json()["error"]["message"]
    assert "BROKER_WEBHOOK_ALLOW_PRIVATE" in response.json()["error"]["message"]
    # An open broker without a list: public hosts on 80 and 443 only.
    open_broker = broker_factory(**FAST)
    response = post_turn(open_broker, "ssrf-3", {"url": f"http://127.0.0.1:{tcp_redis}/"})
    assert response.status_code == 422, response.text
    assert connections_received(tcp_redis) == before + 1  # this look's own, nothing else
    for running in (broker, port_listed, open_broker):
        assert running.metric("broker_turns_started_total") == 0


def test_a_url_that_resolves_to_loopback_at_send_time_is_refused_and_counted(
    broker_factory: BrokerFactory, receivers: Any
) -> None:
    """A name accepted earlier is checked again, after resolution, when it is sent."""
    port = free_port()  # nothing listens yet: the first broker cannot send it
    url = f"http://localhost:{port}/hooks/turns"
    settings = {**FAST, "webhook_max_tries": 1000, "webhook_timeout_s": 0.5}
    first = broker_factory(**settings, webhook_hosts=f"localhost:{port}", webhook_allow_private=1)
    response = post_turn(first, "rebind-1", {"url": url})
    assert response.status_code == 201, response.text
    wait_final(first.base_url, "rebind-1")
    wait_until(lambda: first.metric(RETRIED) >= 1)
    first.stop()

    receiver: Receiver = receivers(port=port)
    second = broker_factory(
        **settings, webhook_hosts=f"localhost:{port}", key_prefix=first.settings.key_prefix
    )
    wait_until(lambda: second.metric(GAVE_UP) == 1, timeout=15)
    assert second.metric(ADDRESS_REFUSED) == 1
    assert receiver.deliveries == []


def test_an_allowed_private_name_is_sent_to_the_address_checked_with_its_host_kept(
    broker_factory: BrokerFactory, receivers: Any
) -> None:
    receiver: Receiver = receivers()
    port = receiver.host.rpartition(":")[2]
    broker = broker_factory(**FAST, webhook_hosts=f"localhost:{port}", webhook_allow_private=1)
    url = f"http://localhost:{port}/hooks/turns"
    assert post_turn(broker, "pinned-1", {"url": url}).status_code == 201
    (delivery,) = receiver.wait_for(1)
    assert delivery.headers["host"] == f"localhost:{port}"
    assert delivery.payload["data"]["turn_id"] == "pinned-1"


def test_the_tenants_urls_of_the_settings_are_the_operators_and_not_checked(
    broker_factory: BrokerFactory, receivers: Any
) -> None:
    receiver: Receiver = receivers()
    broker = broker_factory(**FAST, webhook_url=receiver.url)  # loopback, any port
    assert post_turn(broker, "operator-1").status_code == 201
    receiver.wait_for(1)


# --- pure parts ------------------------------------------------------------------------------

V4 = ipaddress.IPv4Network
V6 = ipaddress.IPv6Network


@pytest.mark.parametrize(
    ("raw", "entry"),
    [
        ("hooks.example.com", HostEntry("hooks.example.com")),
        ("Hooks.Example.com:8443", HostEntry("hooks.example.com", None, 8443)),
        ("*.example.com", HostEntry("*.example.com")),
        ("*.example.com:8443", HostEntry("*.example.com", None, 8443)),
        ("*", HostEntry("*")),
        ("*:8080", HostEntry("*", None, 8080)),
        ("localhost", HostEntry("localhost")),
        ("127.0.0.1", HostEntry("", V4("127.0.0.1/32"))),
        ("127.0.0.1:8080", HostEntry("", V4("127.0.0.1/32"), 8080)),
        ("10.0.0.0/8", HostEntry("", V4("10.0.0.0/8"))),
        ("10.0.0.0/8:443", HostEntry("", V4("10.0.0.0/8"), 443)),
        ("[::1]", HostEntry("", V6("::1/128"))),
        ("[::1]:8080", HostEntry("", V6("::1/128"), 8080)),
        ("[fd00::/8]:9000", HostEntry("", V6("fd00::/8"), 9000)),
    ],
)
def test_an_allow_list_entry_reads_as_host_and_port(raw: str, entry: HostEntry) -> None:
    assert parse_entry(raw) == entry


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("a b", "not a host name"),
        ("::1", "without brackets"),
        ("[::1", "[address]:port"),
        ("[::1]8080", "[address]:port"),
        ("[127.0.0.1]", "not IPv6"),
        ("[hooks]", "not IPv6"),
        ("hooks.example.com:0", "bad port"),
        ("hooks.example.com:65536", "bad port"),
        ("hooks.example.com:http", "bad port"),
        ("10.0.0.1/8", "bad address"),
        ("*.*.example.com", "not a host name"),
    ],
)
def test_a_bad_allow_list_entry_is_refused_with_a_reason(raw: str, message: str) -> None:
    with pytest.raises(WebhookConfigError, match=message.replace("[", r"\[")):
        parse_entry(raw)


def config(hosts: str = "", *, allow_private: bool = False, secured: bool = False) -> WebhookConfig:
    settings = Settings(
        webhook_secret=SECRET,
        webhook_hosts=hosts or None,
        webhook_allow_private=int(allow_private),
    )
    return WebhookConfig.from_settings(settings, secured=secured)


@pytest.mark.parametrize(
    ("hosts", "allow_private", "url", "refused"),
    [
        # An open broker without a list: any public host, on 80 and 443.
        ("", False, "https://hooks.example.com/x", None),
        ("", False, "http://hooks.example.com/x", None),
        ("", False, "http://hooks.example.com:443/x", None),
        ("", False, "http://hooks.example.com:8080/x", "port"),
        ("", False, "http://127.0.0.1/x", "address"),
        ("", False, "http://localhost/x", "address"),
        ("", False, "http://app.localhost/x", "address"),
        ("", False, "http://8.8.8.8/x", None),
        # Ports: an entry without one allows 80 and 443; with one, that port only.
        ("localhost", False, "http://localhost:6379/", "port"),
        ("localhost", True, "http://localhost:6379/", "port"),
        ("localhost:6379", False, "http://localhost:6379/", "address"),
        ("localhost:8000", True, "http://localhost:8000/", None),
        ("localhost:8000", True, "http://localhost:8001/", "port"),
        ("*:8443", False, "https://hooks.example.com:8443/", None),
        ("*:8443", False, "https://hooks.example.com/", "port"),
        ("*.example.com:8443", False, "https://a.example.com:8443/", None),
        ("*.example.com:8443", False, "https://example.com:8443/", "host"),
        ("hooks.example.com", False, "https://other.example.com/", "host"),
        # An address or range listed is allowed, and only on its ports.
        ("127.0.0.1:8000", False, "http://127.0.0.1:8000/", None),
        ("127.0.0.1:8000", False, "http://127.0.0.1:6379/", "port"),
        ("127.0.0.1", False, "http://127.0.0.1/", None),
        ("10.0.0.0/8", False, "https://10.1.2.3/", None),
        ("10.0.0.0/8", False, "https://11.0.0.1/", "host"),
        ("[::1]:8080", False, "http://[::1]:8080/", None),
        ("169.254.169.254", False, "http://169.254.169.254/", None),
        # Non-public addresses under `*`, in every spelling.
        ("*", False, "http://169.254.169.254/", "address"),
        ("*", True, "http://169.254.169.254/", "address"),  # link-local: only when listed
        ("*", False, "http://[::1]/", "address"),
        ("*", False, "http://[::ffff:127.0.0.1]/", "address"),
        ("*", False, "http://[64:ff9b::7f00:1]/", "address"),
        ("*", False, "http://[2002:7f00:1::]/", "address"),
        ("*", False, "http://127.1/", "address"),
        ("*", False, "http://0x7f000001/", "address"),
        ("*", False, "http://0.0.0.0/", "address"),
        ("*", True, "http://0.0.0.0/", "address"),  # unspecified: never
        ("*", True, "http://224.0.0.1/", "address"),  # multicast: never
        ("*", False, "http://10.0.0.1/", "address"),
        ("*", True, "http://10.0.0.1/", None),
        ("*", False, "http://[fd00::1]/", "address"),
        ("*", True, "http://[fd00::1]/", None),
        ("*", False, "http://100.64.0.1/", "address"),
        ("*", True, "http://127.0.0.1/", None),
    ],
)
def test_a_notify_url_is_refused_for_its_host_port_or_address(
    hosts: str, allow_private: bool, url: str, refused: str | None
) -> None:
    refusal = config(hosts, allow_private=allow_private).url_refusal(urllib.parse.urlsplit(url))
    assert (refusal[0] if refusal else None) == refused, refusal


def test_a_secured_broker_without_a_list_takes_no_per_turn_url() -> None:
    refusal = config(secured=True).url_refusal(urllib.parse.urlsplit("https://h.example.com/"))
    assert refusal is not None
    assert refusal[0] == "host"
    assert "BROKER_WEBHOOK_HOSTS is unset" in refusal[1]


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("8.8.8.8", "global"),
        ("2606:4700::1111", "global"),
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "private"),
        ("fd12::1", "private"),
        ("fec0::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("ff02::1", "multicast"),
        ("::ffff:10.0.0.1", "private"),
        ("64:ff9b::a9fe:a9fe", "link-local"),
        ("2002:0808:0808::", "global"),
    ],
)
def test_addresses_are_public_or_named_for_their_kind(address: str, kind: str) -> None:
    assert address_kind(ipaddress.ip_address(address)) == kind


def test_the_private_allowance_is_0_or_1() -> None:
    assert Settings.from_env({"BROKER_WEBHOOK_ALLOW_PRIVATE": "1"}).webhook_allow_private == 1
    with pytest.raises(SettingsError, match="BROKER_WEBHOOK_ALLOW_PRIVATE must be 0 or 1"):
        Settings(webhook_allow_private=2)
