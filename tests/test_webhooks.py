"""Completion webhooks: a real broker POSTs each attempt's end to a real receiver, signed (checked
with the Standard Webhooks reference library), retried with the same ``webhook-id``, and never
lost when the broker that could not send it stops."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import itertools
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.asyncio import Redis
from standardwebhooks import Webhook, WebhookVerificationError

from broker.keys import Keys
from broker.notifier import backoff_ms, hold_ms
from broker.scripts import Scripts
from broker.settings import Settings, SettingsError
from broker.webhook_config import (
    WebhookConfig,
    decode_secret,
    host_allowed,
    new_secret,
    parse_hosts,
    sign,
    webhook_id,
)
from tests.conftest import BrokerFactory, RunningBroker, free_port
from tests.helpers import ToolEndpoint, bearer, get_turn, read_sse, wait_final, wait_until

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
# Webhooks on, every wait short: a look every 100 ms, retries after 10 to 40 ms.
FAST = {
    "webhook_secret": SECRET,
    "webhook_recheck_ms": 100,
    "webhook_backoff_ms": 20,
    "webhook_backoff_max_ms": 40,
    "webhook_timeout_s": 2.0,
}
DELIVERED = 'broker_webhook_deliveries_total{outcome="delivered"}'
RETRIED = 'broker_webhook_deliveries_total{outcome="retried"}'
GAVE_UP = 'broker_webhook_deliveries_total{outcome="gave_up"}'
_scripted = itertools.count()


@dataclasses.dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def payload(self) -> dict[str, Any]:
        """The body, once its signature checks out with the reference library."""
        verified: dict[str, Any] = Webhook(SECRET).verify(self.body, self.headers)
        return verified


class Receiver:
    """A webhook receiver on loopback: records every POST, answers each with the next status of
    ``statuses`` (200 once they run out)."""

    def __init__(self, statuses: tuple[int, ...] = (), port: int = 0) -> None:
        self.deliveries: list[Delivery] = []
        self._statuses = list(statuses)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver.deliveries.append(Delivery(headers, body))
                status = receiver._statuses.pop(0) if receiver._statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/turns"
        # The allow-list entry that lets per-turn URLs reach it: loopback, so named explicitly.
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Delivery]:
        wait_until(lambda: len(self.deliveries) >= count, timeout)
        return list(self.deliveries)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def factory(*statuses: int, port: int = 0) -> Receiver:
        receiver = Receiver(statuses, port)
        started.append(receiver)
        return receiver

    yield factory
    for receiver in started:
        receiver.close()


def post_turn(
    broker: RunningBroker,
    turn_id: str,
    notify: Any = None,
    *,
    auth: str | None = None,
    **simulate: Any,
) -> httpx.Response:
    body: dict[str, Any] = {
        "conversation_id": "hooks",
        "turn_id": turn_id,
        "messages": [{"role": "user", "content": f"say {turn_id}"}],
        "params": {"simulate": {"tokens": 5, "tokens_per_s": 0, **simulate}},
    }
    if notify is not None:
        body["notify"] = notify
    return httpx.post(f"{broker.base_url}/v1/turns", json=body, headers=bearer(auth), timeout=10)


def webhook_jobs(raw_redis: redis.Redis, broker: RunningBroker) -> int:
    """Notification jobs still in the broker's webhook partitions (pending or not yet read)."""
    prefix, partitions = broker.settings.key_prefix, broker.settings.job_partitions
    return sum(int(raw_redis.xlen(f"{prefix}:{{webhooks:{i}}}")) for i in range(partitions))


def test_a_finished_turn_is_posted_signed_with_its_state(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    response = post_turn(broker, "done-1", {"url": receiver.url})
    assert response.status_code == 201, response.text
    stream_id = response.json()["stream_id"]

    (delivery,) = receiver.wait_for(1)
    payload = delivery.payload
    turn = wait_final(broker.base_url, "done-1")
    end = read_sse(broker.base_url, stream_id).events[-1]
    assert end.event == "end"
    assert payload["type"] == "turn.finished"
    assert payload["data"] == {
        "turn_id": "done-1",
        "conversation_id": "hooks",
        "tenant": None,
        "stream_id": stream_id,
        "attempt": 1,
        "status": "complete",
        "reason": None,
        "canonical_attempt": 1,
        "canonical_text_length": len(turn["canonical"]["text"]),
        "last_offset": end.id,
    }
    assert payload["data"]["canonical_text_length"] > 0
    assert delivery.headers["webhook-id"] == f"msg_{stream_id}_1"
    assert delivery.headers["content-type"] == "application/json"
    # The signature covers the body: one byte changed and the reference library refuses it.
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(delivery.body.replace(b"complete", b"failed"), delivery.headers)

    # Settled: acknowledged and deleted, so nothing is sent again.
    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)
    assert broker.metric(DELIVERED) == 1
    assert broker.metric(RETRIED) == broker.metric(GAVE_UP) == 0
    assert len(receiver.deliveries) == 1
    # The signature is Standard Webhooks' own, as an independent HMAC computes it.
    key = decode_secret(SECRET)
    timestamp = int(delivery.headers["webhook-timestamp"])
    expected = sign(key, delivery.headers["webhook-id"], timestamp, delivery.body)
    assert delivery.headers["webhook-signature"] == expected


def test_a_turn_that_ends_with_client_tool_calls_is_posted_requires_action(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver]
) -> None:
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    body = {
        "conversation_id": "hooks",
        "turn_id": "calls-1",
        "messages": [{"role": "user", "content": "what time is it?"}],
        "client_tools": [{"name": "get_time"}],
        "notify": {"url": receiver.url},
        "params": {
            "simulate": {"tokens": 5, "tokens_per_s": 0, "tool_calls": [{"name": "get_time"}]}
        },
    }
    response = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)
    assert response.status_code == 201, response.text
    (delivery,) = receiver.wait_for(1)
    data = delivery.payload["data"]
    assert (data["status"], data["reason"], data["canonical_attempt"]) == (
        "requires_action",
        "tool_calls",
        1,
    )


def test_the_notification_is_in_redis_before_the_turn_can_end(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    response = post_turn(broker, "slow-1", {"url": receiver.url}, tokens=400, tokens_per_s=20)
    assert response.status_code == 201, response.text
    assert webhook_jobs(raw_redis, broker) == 1  # queued with the turn, before its first delta
    assert receiver.deliveries == []  # the turn is not at rest: nothing is sent
    cancelled = httpx.post(f"{broker.base_url}/v1/turns/slow-1/cancel", timeout=10)
    assert cancelled.status_code == 200

    (delivery,) = receiver.wait_for(1)
    assert delivery.payload["data"]["status"] == "cancelled"
    assert delivery.payload["data"]["reason"] == "cancelled"
    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)


def test_a_500_is_retried_with_the_same_id_and_stops_after_the_2xx(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    receiver = receivers(500)
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    assert post_turn(broker, "retry-1", {"url": receiver.url}).status_code == 201

    first, second = receiver.wait_for(2)
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert first.body == second.body  # the same notification, taken once
    assert first.payload == second.payload
    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)
    wait_until(lambda: broker.metric(DELIVERED) == 1)
    assert broker.metric(RETRIED) == 1
    assert len(receiver.deliveries) == 2


def test_a_notification_is_given_up_after_the_last_try(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    receiver = receivers(503, 503, 503, 503)
    broker = broker_factory(**FAST, webhook_max_tries=3, webhook_hosts=receiver.host)
    assert post_turn(broker, "doomed-1", {"url": receiver.url}).status_code == 201

    wait_until(lambda: broker.metric(GAVE_UP) == 1)
    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)
    assert len(receiver.deliveries) == 3
    assert broker.metric(RETRIED) == 2
    assert broker.metric(DELIVERED) == 0


def test_a_notification_the_broker_could_not_send_is_sent_by_the_next_broker(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    port = free_port()  # nothing listens yet: every send is refused
    url = f"http://127.0.0.1:{port}/hooks/turns"
    settings = {
        **FAST,
        "webhook_max_tries": 1000,
        "webhook_timeout_s": 0.5,
        "webhook_hosts": f"127.0.0.1:{port}",
    }
    first = broker_factory(**settings)
    response = post_turn(first, "restart-1", {"url": url})
    assert response.status_code == 201, response.text
    wait_final(first.base_url, "restart-1")
    wait_until(lambda: first.metric(RETRIED) >= 1)
    first.stop()
    assert webhook_jobs(raw_redis, first) == 1  # still pending, in Redis only

    receiver = receivers(port=port)
    second = broker_factory(**settings, key_prefix=first.settings.key_prefix)
    (delivery,) = receiver.wait_for(1, timeout=15)
    assert delivery.payload["data"]["turn_id"] == "restart-1"
    assert delivery.headers["webhook-id"] == f"msg_{response.json()['stream_id']}_1"
    wait_until(lambda: webhook_jobs(raw_redis, second) == 0)
    assert second.metric(DELIVERED) == 1


def test_a_second_job_for_a_delivered_attempt_is_settled_unsent(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], raw_redis: redis.Redis
) -> None:
    """A rescue racing the creating request may queue an attempt's notification twice."""
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    assert post_turn(broker, "twice-1", {"url": receiver.url}).status_code == 201
    receiver.wait_for(1)
    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)
    conversation_id = "hooks"  # an open broker's conversations are not scoped
    runtime = broker.runtime
    # The worker may settle it before any look here could count it: the job id says it was
    # queued, the receiver's count that it was not sent again.
    assert broker.call(runtime.webhooks.queue.enqueue(conversation_id, "twice-1", 1))

    wait_until(lambda: webhook_jobs(raw_redis, broker) == 0)
    assert len(receiver.deliveries) == 1
    assert broker.metric(DELIVERED) == 1


async def test_take_webhook_takes_holds_and_knows_a_delivered_attempt(aredis: Redis) -> None:
    scripts = Scripts(aredis)
    stream = Keys(f"wh{os.getpid()}-{next(_scripted)}").job_stream(0, "webhooks")
    keys = {"delivery": f"{stream}:try:1-0", "hold": f"{stream}:hold:1-0"}
    sent = f"{stream}:sent:c t 1"

    async def take(body: str) -> Any:
        return await scripts.take_webhook(
            **keys,
            sent=sent,
            body=body,
            url="http://h/x",
            ended_ms=5,
            hold_ms=60_000,
            ttl_ms=60_000,
        )

    first = await take("first")
    assert (first.result, first.tries, first.body, first.url, first.ended_ms) == (
        "take",
        0,
        "first",
        "http://h/x",
        5,
    )
    held = await take("second")
    assert held.result == "wait"
    assert 0 < held.wait_ms <= 60_000
    await aredis.delete(keys["hold"])  # the hold ran out (a crashed send, a backoff over)
    await aredis.hset(keys["delivery"], "tries", 3)
    again = await take("second")
    assert (again.result, again.tries, again.body) == ("take", 3, "first")  # the first body
    await aredis.set(sent, "1")
    await aredis.delete(keys["hold"])
    assert (await take("third")).result == "sent"


def test_a_regenerate_notifies_again_with_a_new_id(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver]
) -> None:
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=receiver.host)
    response = post_turn(broker, "again-1", {"url": receiver.url})
    stream_id = response.json()["stream_id"]
    receiver.wait_for(1)
    wait_final(broker.base_url, "again-1")
    again = httpx.post(
        f"{broker.base_url}/v1/turns/again-1/attempts", json={"strategy": "regenerate"}, timeout=10
    )
    assert again.status_code == 201, again.text

    first, second = receiver.wait_for(2)
    assert first.headers["webhook-id"] == f"msg_{stream_id}_1"
    assert second.headers["webhook-id"] == f"msg_{stream_id}_2"
    data = second.payload["data"]
    assert (data["attempt"], data["status"], data["canonical_attempt"]) == (2, "complete", 2)
    assert data["last_offset"] > first.payload["data"]["last_offset"]
    assert data["canonical_text_length"] == len(
        get_turn(broker.base_url, "again-1")["canonical"]["text"]
    )


def test_a_tenant_url_receives_its_tenants_turns_and_the_default_the_others(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver]
) -> None:
    acme, everyone = receivers(), receivers()
    acme_key, globex_key = "acme-key-0123456789abcdef", "globex-key-0123456789abcdef"
    broker = broker_factory(
        **FAST,
        api_keys=f"acme={acme_key},globex={globex_key}",
        webhook_urls=f"acme={acme.url}",
        webhook_url=everyone.url,
    )
    assert post_turn(broker, "t-acme", auth=acme_key).status_code == 201
    (delivery,) = acme.wait_for(1)
    data = delivery.payload["data"]
    # The conversation as the client named it, not the broker's tenant-scoped id.
    assert (data["tenant"], data["conversation_id"], data["turn_id"]) == ("acme", "hooks", "t-acme")

    assert post_turn(broker, "t-globex", auth=globex_key).status_code == 201
    (other,) = everyone.wait_for(1)
    assert (other.payload["data"]["tenant"], other.payload["data"]["turn_id"]) == (
        "globex",
        "t-globex",
    )
    assert len(acme.deliveries) == 1


def test_a_turn_without_a_target_queues_no_notification(
    broker_factory: BrokerFactory, raw_redis: redis.Redis
) -> None:
    broker = broker_factory(**FAST)  # a secret, but no URL for the open tenant
    assert post_turn(broker, "quiet-1").status_code == 201
    wait_final(broker.base_url, "quiet-1")
    assert webhook_jobs(raw_redis, broker) == 0


@pytest.mark.parametrize(
    ("notify", "code"),
    [
        ({"url": "ftp://127.0.0.1/hook"}, "bad_notify"),
        ({"url": "http://"}, "bad_notify"),
        ({"url": "http://user:secret@127.0.0.1/hook"}, "bad_notify"),
        ({"url": "http://127.0.0.1:99999/hook"}, "bad_notify"),
        ({"url": "http://127.0.0.1/a b"}, "bad_notify"),
        ({"url": "http://127.0.0.1/" + "a" * 2048}, "bad_request"),
        ({"url": 5}, "bad_request"),
        ({"url": ""}, "bad_request"),
        ({"uri": "http://127.0.0.1/hook"}, "bad_request"),
        ("http://127.0.0.1/hook", "bad_request"),
    ],
)
def test_bad_notify_input_is_a_400_in_the_error_shape(
    broker: RunningBroker, notify: Any, code: str
) -> None:
    response = post_turn(broker, "bad-1", notify)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert "notify" in error["message"] or "url" in error["message"]


def test_notify_on_a_broker_without_webhooks_is_a_422(broker: RunningBroker) -> None:
    response = post_turn(broker, "off-1", {"url": "http://127.0.0.1:9/hook"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "notify_not_allowed"
    assert "BROKER_WEBHOOK_SECRET" in response.json()["error"]["message"]


def test_the_host_allow_list_refuses_other_hosts(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver]
) -> None:
    receiver = receivers()
    broker = broker_factory(**FAST, webhook_hosts=f"{receiver.host},*.hooks.example.com")
    for url in (
        receiver.url.replace("127.0.0.1", "localhost"),
        receiver.url.replace(receiver.host, "127.0.0.1:6379"),  # the right host, not its port
        "https://hooks.example.com/x",
        "https://evil.example.com/x",
    ):
        response = post_turn(broker, "hosts-1", {"url": url})
        assert response.status_code == 422, (url, response.text)
        assert response.json()["error"]["code"] == "notify_not_allowed"
        assert "BROKER_WEBHOOK_HOSTS" in response.json()["error"]["message"]
    assert post_turn(broker, "hosts-1", {"url": receiver.url}).status_code == 201
    receiver.wait_for(1)


def test_a_secured_broker_takes_no_per_turn_url_without_an_allow_list(
    broker_factory: BrokerFactory,
) -> None:
    key = "acme-key-0123456789abcdef"
    broker = broker_factory(**FAST, api_keys=f"acme={key}")
    response = post_turn(broker, "sec-1", {"url": "http://127.0.0.1:9/hook"}, auth=key)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "notify_not_allowed"


# --- pure parts ------------------------------------------------------------------------------


def test_host_allow_list_entries_match_names_wildcards_and_literals() -> None:
    allowed = parse_hosts("hooks.example.com,*.push.example.net,[::1]")
    assert host_allowed("hooks.example.com", 443, allowed)
    assert host_allowed("eu.push.example.net", 443, allowed)
    assert host_allowed("::1", 80, allowed)
    assert not host_allowed("push.example.net", 443, allowed)  # the wildcard is for names under it
    assert not host_allowed("hooks.example.com.evil.org", 443, allowed)
    assert not host_allowed("xhooks.example.com", 443, allowed)
    assert host_allowed("anything.org", 443, parse_hosts("*"))


def test_an_open_broker_takes_any_public_host_without_an_allow_list() -> None:
    settings = Settings(webhook_secret=SECRET)
    url = urllib.parse.urlsplit("https://a.example.org/hook")
    assert WebhookConfig.from_settings(settings, secured=False).url_refusal(url) is None
    refusal = WebhookConfig.from_settings(settings, secured=True).url_refusal(url)
    assert refusal is not None
    assert refusal[0] == "host"


def test_the_signature_is_the_reference_librarys() -> None:
    import datetime

    body = b'{"type":"turn.finished"}'
    ours = sign(decode_secret(SECRET), "msg_1", 1_700_000_000, body)
    moment = datetime.datetime.fromtimestamp(1_700_000_000, tz=datetime.UTC)
    assert ours == Webhook(SECRET).sign("msg_1", moment, body.decode())
    assert webhook_id("st_0f", 3) == "msg_st_0f_3"


def test_a_new_secret_is_accepted_by_the_settings_and_the_reference_library() -> None:
    secret = new_secret()
    assert len(decode_secret(secret)) == 32
    Webhook(secret)  # the reference library reads it
    assert Settings(webhook_secret=secret, webhook_url="https://h.example.com/x").webhook_url


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    for failed, ceiling in ((1, 1000), (2, 2000), (3, 4000), (7, 60_000), (200, 60_000)):
        pauses = {backoff_ms(failed, 1000, 60_000) for _ in range(50)}
        assert all(ceiling // 2 <= p <= ceiling for p in pauses), (failed, pauses)
        assert len(pauses) > 1  # jittered
    assert hold_ms(10.0) == 15_000
    assert hold_ms(0.5) == 1_000


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"webhook_url": "https://h.example.com/x"}, "BROKER_WEBHOOK_SECRET is not"),
        ({"webhook_urls": "acme=https://h.example.com/x"}, "BROKER_WEBHOOK_SECRET is not"),
        ({"webhook_secret": "c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"}, "whsec_<base64>"),
        ({"webhook_secret": "whsec_not*base64!"}, "standard base64"),
        ({"webhook_secret": "whsec_" + base64.b64encode(b"short").decode()}, "24 to 64 bytes"),
        ({"webhook_secret": SECRET, "webhook_url": "ftp://h.example.com/x"}, "http"),
        ({"webhook_secret": SECRET, "webhook_urls": "acme"}, "tenant=url"),
        ({"webhook_secret": SECRET, "webhook_urls": "acme=x,acme=y"}, "URL"),
        ({"webhook_secret": SECRET, "webhook_hosts": "a b"}, "not a host name"),
        ({"webhook_secret": SECRET, "webhook_max_tries": 0}, "BROKER_WEBHOOK_MAX_TRIES"),
        (
            {"webhook_secret": SECRET, "webhook_backoff_ms": 5000, "webhook_backoff_max_ms": 10},
            "BROKER_WEBHOOK_BACKOFF_MS",
        ),
    ],
)
def test_webhook_settings_refuse_to_start_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(SettingsError, match="BROKER_WEBHOOK") as caught:
        Settings(**values)
    assert message in str(caught.value)
    assert "AAECAwQF" not in str(caught.value)  # the secret is never repeated


def test_webhook_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "BROKER_WEBHOOK_SECRET": SECRET,
            "BROKER_WEBHOOK_URLS": "acme=https://a.example.com/h,globex=https://g.example.com/h",
            "BROKER_WEBHOOK_HOSTS": "*.example.com",
            "BROKER_WEBHOOK_MAX_TRIES": "5",
        }
    )
    config = WebhookConfig.from_settings(settings, secured=True)
    assert config.tenant_url("globex") == "https://g.example.com/h"
    assert config.tenant_url("other") is None
    assert config.url_refusal(urllib.parse.urlsplit("https://x.example.com/h")) is None
    assert settings.webhook_max_tries == 5
    assert SECRET not in repr(settings)  # never printed


def test_an_approval_request_is_posted_at_once_then_the_end_after_the_decision(
    broker_factory: BrokerFactory, receivers: Callable[..., Receiver], tmp_path: Path
) -> None:
    """A tool call that waits for a person is its own notification (``approval.requested``),
    sent while the turn waits, so an app can tell its user; the decision's answer ends the
    turn, whose ``turn.finished`` follows."""
    receiver = receivers()
    payments = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    try:
        tool = {
            "name": "send_payment",
            "class": "unkeyed_write",
            "endpoint": payments.url,
            "timeout_s": 5,
            "approval": "always",
        }
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps({"tools": [tool]}))
        broker = broker_factory(**FAST, webhook_hosts=receiver.host, tools=str(tools))
        calls = [{"name": "send_payment", "args": {"to": "bob", "amount": 500}, "after": 2}]
        response = post_turn(broker, "asks-1", {"url": receiver.url}, tool_calls=calls)
        assert response.status_code == 201, response.text
        stream_id = response.json()["stream_id"]
        (delivery,) = receiver.wait_for(1)
        payload = delivery.payload
        turn = wait_until(
            lambda: (
                (t := get_turn(broker.base_url, "asks-1"))["status"] == "awaiting_approval" and t
            )
        )
        (pending,) = turn["approvals"]
        assert payload["type"] == "approval.requested"
        assert payload["data"] == {
            "turn_id": "asks-1",
            "conversation_id": "hooks",
            "tenant": None,
            "stream_id": stream_id,
            "attempt": 1,
            "approval_id": pending["approval_id"],
            "name": "send_payment",
            "ordinal": 0,
            "expires_at": pending["expires_at"],
        }
        assert delivery.headers["webhook-id"] == f"msg_{stream_id}_{pending['approval_id']}"
        assert payments.requests == [], "told, not run"

        decided = httpx.post(
            f"{broker.base_url}/v1/turns/asks-1/approvals/{pending['approval_id']}",
            json={"decision": "approve"},
            timeout=10,
        )
        assert decided.status_code == 200, decided.text
        _, finished = receiver.wait_for(2)
        assert finished.payload["type"] == "turn.finished"
        assert finished.payload["data"]["status"] == "complete"
        assert finished.headers["webhook-id"] == f"msg_{stream_id}_1"
        wait_final(broker.base_url, "asks-1")
        assert len(payments.requests) == 1
        assert broker.metric(DELIVERED) == 2
    finally:
        payments.close()
