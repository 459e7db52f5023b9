"""Durable Streams subscriptions: the pure rules as tables (globs, configurations, URLs,
signatures), and the leases, marks and wakes against a real Redis with a fake clock (no
waiting). The routes and the official suite's subscription tests run in
test_durable_streams.py."""

from __future__ import annotations

import base64
import itertools
import os
import signal
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from redis.asyncio import Redis

from broker.deps import Deps
from broker.durable_store import (
    AlreadyClaimed,
    AppendRequest,
    CreateRequest,
    DurableStore,
    Subscriptions,
    Wake,
    WakeLoop,
    parse_config,
)
from broker.durable_store import subscriptions as subscriptions_module
from broker.durable_store.keys import KeySpace
from broker.durable_store.protocol import offset_of
from broker.durable_store.sub_model import (
    Signer,
    UrlRejected,
    checked_url,
    glob_matches,
    lua_pattern,
)
from broker.durable_store.subscriptions import MAX_SUBSCRIPTIONS, Fenced, TooManySubscriptions
from broker.errors import BadRequest
from broker.fanout import Hub
from broker.frames import ORIGIN
from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings, SettingsError
from broker.webhook_config import WebhookConfig, parse_hosts
from tests.conftest import BrokerFactory, BrokerProcess
from tests.helpers import ToolEndpoint, bearer, wait_until

_prefixes = itertools.count()
JSON_TYPE = {"Content-Type": "application/json"}
LOOPBACK_ONLY = WebhookConfig(None, None, {}, (), secured=False, allow_loopback=True)
PUBLIC_ONLY = WebhookConfig(None, None, {}, (), secured=False)
SECURED = WebhookConfig(None, None, {}, (), secured=True)
SECURED_LISTED = WebhookConfig(None, None, {}, parse_hosts("hooks.example.com:8443"), secured=True)


# --- the pure rules ----------------------------------------------------------------------------

GLOBS = [
    ("events/*", "events/a", True),
    ("events/*", "events/a/b", False),
    ("events/**", "events/a/b", True),
    ("events/?", "events/a", True),
    ("events/?", "events/ab", False),
    ("a.b/*", "a.b/x", True),
    ("a.b/*", "aXb/x", False),  # "." is a character, not "any"
    ("a%b+(c)", "a%b+(c)", True),  # Lua's magic characters stand for themselves
    ("manual/a", "manual/a", True),
    ("manual/a", "manual/ab", False),
    ("*", "x", True),
    ("*", "x/y", False),
]


@pytest.mark.parametrize(("glob", "path", "matches"), GLOBS)
def test_a_glob_matches_as_the_documentation_says(glob: str, path: str, matches: bool) -> None:
    assert glob_matches(glob, path) is matches


def test_a_glob_becomes_an_anchored_lua_pattern() -> None:
    assert lua_pattern("events/*") == "^events/[^/]*$"
    assert lua_pattern("a/**") == "^a/.*$"
    assert lua_pattern("a.b?-") == "^a%.b[^/]%-$"


BAD_CONFIGS = [
    ([], "JSON object"),
    ({"type": "push", "pattern": "a/*", "webhook": {"url": "https://x"}}, "type"),
    ({"type": "webhook", "webhook": {"url": "https://x"}}, "pattern or streams"),
    ({"type": "webhook", "pattern": "a/*"}, "webhook.url"),
    ({"type": "webhook", "pattern": "a/*", "webhook": {"url": 1}}, "webhook"),
    ({"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://x", "y": 1}}, "webhook"),
    ({"type": "pull-wake", "pattern": "a/*"}, "wake_stream"),
    ({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w", "lease_ttl_ms": 5}, "lease_ttl"),
    ({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w", "lease_ttl_ms": 1.5}, "lease_ttl"),
    ({"type": "pull-wake", "streams": [], "wake_stream": "w"}, "streams"),
    ({"type": "pull-wake", "streams": [1], "wake_stream": "w"}, "streams"),
    ({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w", "secret": "x"}, "'secret'"),
]


@pytest.mark.parametrize(("body", "named"), BAD_CONFIGS)
def test_a_bad_configuration_is_a_400_naming_the_field(body: Any, named: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_config(body)
    assert caught.value.status == 400
    assert named in caught.value.message


@pytest.mark.parametrize("value", [2, -1])
def test_the_loopback_allowance_is_0_or_1(value: int) -> None:
    with pytest.raises(SettingsError, match="BROKER_WEBHOOK_ALLOW_LOOPBACK"):
        Settings(redis_url="unix:///unused", webhook_allow_loopback=value)


def test_equal_configurations_are_written_alike() -> None:
    one = parse_config({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w"})
    two = parse_config({"wake_stream": "w", "pattern": "a/*", "type": "pull-wake"})
    assert one.canonical == two.canonical
    assert one.lease_ttl_ms == 30_000


URLS = [
    (LOOPBACK_ONLY, "http://127.0.0.1:4567/hook", True),
    (LOOPBACK_ONLY, "http://localhost:4567/hook", True),
    (LOOPBACK_ONLY, "http://[::1]:4567/hook", True),
    (LOOPBACK_ONLY, "http://10.0.0.1/hook", False),  # private ranges stay closed
    (LOOPBACK_ONLY, "http://169.254.169.254/latest", False),  # link-local (metadata services)
    (LOOPBACK_ONLY, "http://0.0.0.0/hook", False),
    (PUBLIC_ONLY, "http://127.0.0.1:4567/hook", False),
    (PUBLIC_ONLY, "https://hooks.example.com:8443/x", True),  # names are checked when sent
    (PUBLIC_ONLY, "https://8.8.8.8/x", True),
    (PUBLIC_ONLY, "ftp://8.8.8.8/x", False),
    (PUBLIC_ONLY, "https://user:pw@8.8.8.8/x", False),
    (SECURED, "https://8.8.8.8/x", False),  # credentials on: only what the allow-list names
    (SECURED_LISTED, "https://hooks.example.com:8443/x", True),
    (SECURED_LISTED, "https://hooks.example.com/x", False),  # its port is 8443
    (SECURED_LISTED, "https://8.8.8.8/x", False),
]


@pytest.mark.parametrize(("config", "url", "allowed"), URLS)
def test_webhook_urls_follow_the_broker_s_address_rules(
    config: WebhookConfig, url: str, allowed: bool
) -> None:
    if allowed:
        assert checked_url(config, url) == url
        return
    with pytest.raises(UrlRejected) as caught:
        checked_url(config, url)
    assert (caught.value.status, caught.value.code) == (400, "WEBHOOK_URL_REJECTED")


def _verify(jwks: dict[str, Any], header: str, body: bytes) -> bool:
    fields = dict(part.split("=", 1) for part in header.split(","))
    key = next(k for k in jwks["keys"] if k["kid"] == fields["kid"])
    public = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(key["x"] + "=="))
    signature = base64.urlsafe_b64decode(fields["ed25519"] + "==")
    try:
        public.verify(signature, f"{fields['t']}.".encode() + body)
    except InvalidSignature:
        return False
    return True


def test_a_signature_verifies_with_the_jwks_and_not_for_another_body() -> None:
    signer = Signer(bytes(range(32)))
    header = signer.header(1_700_000_000, b'{"a":1}')
    assert header.startswith(f"t=1700000000,kid={signer.kid},ed25519=")
    assert signer.kid.startswith("ds_")
    jwks = signer.jwks
    assert jwks["keys"][0] | {"x": ""} == {
        "kty": "OKP",
        "crv": "Ed25519",
        "alg": "EdDSA",
        "use": "sig",
        "kid": signer.kid,
        "x": "",
    }
    assert _verify(jwks, header, b'{"a":1}')
    assert not _verify(jwks, header, b'{"a":2}')


# --- against Redis -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


async def _made(aredis: Redis, clock: Clock, prefix: str = "") -> tuple[Subscriptions, Hub]:
    prefix = prefix or f"dssubs{os.getpid()}-{next(_prefixes)}"
    metrics = Metrics()
    settings = Settings(redis_url="unix:///unused", key_prefix=prefix, webhook_backoff_ms=1000)
    deps = Deps(aredis, Scripts(aredis), Keys(prefix), settings, metrics)
    hub = Hub(aredis, metrics)
    store = DurableStore(deps, hub)
    return Subscriptions(deps, store, clock), hub


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def subs(aredis: Redis, clock: Clock) -> AsyncIterator[Subscriptions]:
    made, hub = await _made(aredis, clock)
    yield made
    await hub.close()


def _store(subs: Subscriptions) -> DurableStore:
    store: DurableStore = subs._store
    return store


WEBHOOK = {"type": "webhook", "pattern": "events/*", "lease_ttl_ms": 1000}
HOOK = {"webhook": {"url": "http://127.0.0.1:9/hook"}}
PULL = {"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake", "lease_ttl_ms": 1000}


async def _pull(subs: Subscriptions, sub_id: str = "p") -> None:
    await _store(subs).create("t", "wake", CreateRequest(content_type="application/json"))
    assert await subs.put("t", sub_id, parse_config(PULL), "http://broker/ds")


async def _append(subs: Subscriptions, path: str, body: bytes = b"x") -> str:
    store = _store(subs)
    text = CreateRequest(content_type="text/plain")
    await store.create("t", path, text)
    done = await store.append("t", path, AppendRequest(content_type="text/plain", body=body))
    return offset_of(done.tail)


@pytest.mark.parametrize(("glob", "path", "matches"), GLOBS)
async def test_the_append_s_mark_matches_as_the_glob_says(
    aredis: Redis, clock: Clock, glob: str, path: str, matches: bool
) -> None:
    subs, hub = await _made(aredis, clock)
    body = {"type": "pull-wake", "pattern": glob, "wake_stream": "wake"}
    await subs.put("t", "g", parse_config(body), "http://broker/ds")
    await _append(subs, path)  # ds_create and ds_append mark in the same call
    assert [s.path for s in await subs.states("t", "g")] == ([path] if matches else [])
    assert await subs.due(10**15) == ([("t", "g")] if matches else [])
    assert await subs.mark("t", path) == int(matches)  # the mark on its own, the same rule
    await hub.close()


def test_a_write_marks_the_keys_the_subscriptions_read() -> None:
    keys = Subscriptions.__new__(Subscriptions)
    keys._space = KeySpace("p")
    mine = keys.keys("acme")
    assert KeySpace("p").of("acme", "x").subs == (mine.registry, mine.links, mine.due, mine.marks)


async def test_a_tenant_without_subscriptions_is_marked_with_nothing_written(
    subs: Subscriptions, aredis: Redis
) -> None:
    await _append(subs, "events/a")
    assert await subs.mark("t", "events/a") == 0
    assert await aredis.exists(subs.keys("t").due, subs.keys("t").links) == 0


async def test_a_claim_is_fenced_once_its_lease_ends_and_another_claims(
    subs: Subscriptions, clock: Clock
) -> None:
    await _pull(subs)
    tail = await _append(subs, "events/a")
    first = await subs.claim("t", "p", "w1")
    assert isinstance(first, Wake)
    assert [(s.path, s.tail_offset, s.has_pending) for s in first.streams] == [
        ("events/a", tail, True)
    ]
    clock.ms += 999
    with pytest.raises(AlreadyClaimed) as caught:
        await subs.claim("t", "p", "w2")
    assert caught.value.holder == "w1"
    clock.ms += 1  # the lease is over: the wake goes to the next claim, one generation on
    second = await subs.claim("t", "p", "w2")
    assert isinstance(second, Wake)
    assert second.generation == first.generation + 1
    stale: dict[str, Any] = {
        "token": first.token,
        "wake_id": first.wake_id,
        "generation": first.generation,
    }
    with pytest.raises(Fenced):
        await subs.ack("t", "p", acks=[("events/a", tail)], done=True, **stale)
    live: dict[str, Any] = {
        "token": second.token,
        "wake_id": second.wake_id,
        "generation": second.generation,
    }
    with pytest.raises(Fenced):  # the right wake with another's token
        await subs.ack("t", "p", acks=[], done=False, **(live | {"token": first.token}))
    with pytest.raises(BadRequest) as refused:  # only the subscription's streams are acked
        await subs.ack("t", "p", acks=[("other/x", tail)], done=False, **live)
    assert refused.value.code == "unknown_stream"
    assert await subs.ack("t", "p", acks=[("events/a", tail)], done=True, **live) == (False, 0)
    with pytest.raises(Fenced):  # a wake that ended is fenced too
        await subs.ack("t", "p", acks=[("events/a", tail)], done=True, **live)
    assert await subs.claim("t", "p", "w1") is None  # nothing pending
    await subs.put("t", "hook", parse_config(WEBHOOK | HOOK), "http://broker/ds")
    with pytest.raises(BadRequest) as refused:  # a webhook subscription's wakes go to its URL
        await subs.claim("t", "hook", "w1")
    assert refused.value.code == "not_pull_wake"


async def test_an_ack_renews_the_lease_and_next_wake_says_what_is_left(
    subs: Subscriptions, clock: Clock
) -> None:
    await _pull(subs)
    first_tail = await _append(subs, "events/a")
    await _append(subs, "events/b")
    wake = await subs.claim("t", "p", "w1")
    assert isinstance(wake, Wake)
    live: dict[str, Any] = {
        "token": wake.token,
        "wake_id": wake.wake_id,
        "generation": wake.generation,
    }
    clock.ms += 900
    await subs.ack("t", "p", acks=[("events/a", first_tail)], done=False, **live)
    clock.ms += 900  # past the first lease, within the renewed one
    with pytest.raises(AlreadyClaimed):
        await subs.claim("t", "p", "w2")
    assert await subs.ack("t", "p", acks=[], done=True, **live) == (True, 0)  # events/b is left
    states = {s.path: s for s in await subs.states("t", "p")}
    assert (states["events/a"].acked_offset, states["events/a"].has_pending) == (first_tail, False)
    assert (states["events/b"].acked_offset, states["events/b"].has_pending) == ("-1", True)


async def test_explicit_streams_are_linked_removed_and_a_delete_leaves_no_key(
    subs: Subscriptions, aredis: Redis
) -> None:
    body = {"type": "pull-wake", "streams": ["manual/a"], "wake_stream": "wake"}
    await subs.put("t", "e", parse_config(body), "http://broker/ds")
    await subs.link("t", "e", "add", ["manual/b"])
    await subs.link("t", "e", "remove", ["manual/b"])
    assert [(s.path, s.link_type) for s in await subs.states("t", "e")] == [
        ("manual/a", "explicit")
    ]
    assert await subs.put("t", "e", parse_config(body), "http://broker/ds") is False
    await subs.delete("t", "e")
    keys = subs.keys("t")
    left = [k async for k in aredis.scan_iter(match=f"{keys.space}:sub*")]
    assert left == []


async def _receiver(answers: list[httpx.Response], seen: list[httpx.Request]) -> httpx.AsyncClient:
    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_a_failed_send_is_retried_after_a_jittered_backoff_then_done_acks(
    subs: Subscriptions, clock: Clock, aredis: Redis
) -> None:
    body = WEBHOOK | {"webhook": {"url": "http://127.0.0.1:9/hook"}}
    await subs.put("t", "h", parse_config(body), "http://broker/ds")
    tail = await _append(subs, "events/a")
    seen: list[httpx.Request] = []
    answers = [httpx.Response(503), httpx.Response(200, json={"done": True})]
    http = await _receiver(answers, seen)
    settings = Settings(redis_url="unix:///unused", webhook_backoff_ms=1000)
    loop = WakeLoop(subs, LOOPBACK_ONLY, http, settings)
    await loop.handle("t", "h")
    assert len(seen) == 1
    due = await aredis.zscore(subs.keys("t").due, "h")
    assert due is not None
    assert clock.ms + 500 <= due <= clock.ms + 1000  # the upper half of the pause, jittered
    assert await subs.due(clock.ms) == []  # not before its time
    clock.ms = int(due)
    assert await subs.due(clock.ms) == [("t", "h")]
    await loop.handle("t", "h")
    assert len(seen) == 2
    sent = orjson.loads(seen[1].content)
    assert (sent["subscription_id"], sent["generation"]) == ("h", 2)
    assert (
        sent["callback_url"] == "http://broker/ds/v1/stream/__ds/subscriptions/h/callback?tenant=t"
    )
    jwks = (await subs.signer()).jwks
    assert _verify(jwks, seen[1].headers["webhook-signature"], seen[1].content)
    [state] = await subs.states("t", "h")
    assert (state.acked_offset, state.has_pending) == (tail, False)
    assert await aredis.hget(subs.keys("t").sub("h"), "tries") is None  # counted from 0 again
    await http.aclose()


async def test_a_crash_between_claim_and_send_loses_no_wake(aredis: Redis, clock: Clock) -> None:
    """A process takes the wake's lease and dies before sending: once the lease ends, the due
    set offers the subscription again and another process sends it, one generation on."""
    dying, hub = await _made(aredis, clock)
    body = WEBHOOK | {"webhook": {"url": "http://127.0.0.1:9/hook"}}
    await dying.put("t", "k", parse_config(body), "http://broker/ds")
    await _append(dying, "events/a")
    taken = await dying.start("t", "k", "deliver", "webhook")
    assert isinstance(taken, Wake)  # ... and the process is gone
    prefix = dying._prefix
    survivor, other_hub = await _made(aredis, clock, prefix)
    assert await survivor.due(clock.ms) == []  # the lease is still running
    clock.ms += 1000
    assert await survivor.due(clock.ms) == [("t", "k")]
    seen: list[httpx.Request] = []
    http = await _receiver([httpx.Response(200, json={})], seen)
    loop = WakeLoop(survivor, LOOPBACK_ONLY, http, Settings(redis_url="unix:///unused"))
    await loop.handle("t", "k")
    assert orjson.loads(seen[0].content)["generation"] == taken.generation + 1
    assert (await survivor.signer()).kid == (await dying.signer()).kid  # one key for all
    await http.aclose()
    await hub.close()
    await other_hub.close()


async def test_a_pull_wake_is_announced_once_on_its_wake_stream(
    subs: Subscriptions, clock: Clock
) -> None:
    await _pull(subs)
    await _append(subs, "events/a")
    loop = WakeLoop(subs, LOOPBACK_ONLY, httpx.AsyncClient(), Settings(redis_url="unix:///u"))
    await loop.handle("t", "p")
    await loop.handle("t", "p")  # told already: not again
    read = await _store(subs).read("t", "wake", ORIGIN)
    events = [orjson.loads(payload) for _, payload in read.items]
    assert events == [{"type": "wake", "subscription_id": "p", "streams": ["events/a"]}]
    assert await subs.due(clock.ms) == []


# --- through the routes, on a broker with credentials -----------------------------------------


def test_subscriptions_belong_to_their_tenant_and_a_wake_s_token_alone_acks(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(api_keys="acme=key-acme-0123456789,beta=key-beta-0123456789")
    ds = f"{broker.base_url}/ds/v1/stream"
    acme, beta = bearer("key-acme-0123456789"), bearer("key-beta-0123456789")
    sub = f"{ds}/__ds/subscriptions/jobs"
    body = {"type": "pull-wake", "pattern": "jobs/*", "wake_stream": "wake/w"}
    assert httpx.put(sub, json=body).status_code == 401
    made = httpx.put(f"{ds}/wake/w", content=b"[]", headers=acme | JSON_TYPE)
    assert made.status_code == 201
    assert httpx.put(sub, json=body, headers=acme).status_code == 201
    assert httpx.get(sub, headers=beta).status_code == 404  # another tenant's is not found
    unknown = httpx.put(f"{ds}/__ds/subscriptions/x", json=body | {"x": 1}, headers=acme)
    assert unknown.status_code == 400
    assert "'x'" in unknown.json()["error"]["message"]
    hook = {"type": "webhook", "pattern": "jobs/*", "webhook": {"url": "https://8.8.8.8/h"}}
    refused = httpx.put(f"{ds}/__ds/subscriptions/h", json=hook, headers=acme)
    assert (refused.status_code, refused.json()["error"]["code"]) == (
        400,
        "WEBHOOK_URL_REJECTED",
    )  # credentials on and no BROKER_WEBHOOK_HOSTS: no webhook URL is taken
    put = httpx.put(f"{ds}/jobs/1", content=b'{"n": 1}', headers=acme | JSON_TYPE)
    assert put.status_code == 201
    claim = httpx.post(f"{sub}/claim", json={"worker": "w1"}, headers=acme)
    assert claim.status_code == 200
    wake = claim.json()
    [stream] = wake["streams"]
    ack = {
        "wake_id": wake["wake_id"],
        "generation": wake["generation"],
        "acks": [{"stream": "jobs/1", "offset": stream["tail_offset"]}],
        "done": True,
    }
    token = bearer(wake["token"])
    wrong = httpx.post(f"{sub}/ack", params={"tenant": "beta"}, json=ack, headers=token)
    assert wrong.status_code == 404  # beta has no such subscription
    done = httpx.post(f"{sub}/ack", params={"tenant": "acme"}, json=ack, headers=token)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": False})
    again = httpx.post(f"{sub}/ack", params={"tenant": "acme"}, json=ack, headers=token)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "FENCED")
    jwks = httpx.get(f"{ds}/__ds/jwks.json")  # public: receivers have no credentials
    assert jwks.status_code == 200
    assert jwks.headers["content-type"].startswith("application/jwk-set+json")
    assert jwks.json()["keys"][0]["kid"].startswith("ds_")
    shown = httpx.get(sub, headers=acme).json()
    assert shown["streams"][0] | {"tail_offset": ""} == {
        "path": "jobs/1",
        "link_type": "pattern",
        "tail_offset": "",
        "acked_offset": stream["tail_offset"],
        "has_pending": False,
    }
    assert httpx.delete(sub, headers=acme).status_code == 204
    assert httpx.get(sub, headers=acme).status_code == 404


def test_a_broker_killed_while_it_holds_a_wake_loses_no_wake(
    broker_processes: Callable[[dict[str, str]], BrokerProcess], redis_url: str
) -> None:
    """A broker sends a wake and is killed (SIGKILL) before its receiver calls back: another
    broker on the same Redis sends it again, one generation on, once the lease ends; the first
    wake's callback is fenced, the second's acks."""
    receiver = ToolEndpoint("/hook", lambda n: {})  # answers without "done": it will call back
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"subkill{os.getpid()}-{next(_prefixes)}",
        "BROKER_WEBHOOK_ALLOW_LOOPBACK": "1",
    }
    try:
        first = broker_processes(env)
        ds = f"{first.base_url}/ds/v1/stream"
        body = WEBHOOK | {"webhook": {"url": receiver.url}}
        assert httpx.put(f"{ds}/__ds/subscriptions/k", json=body).status_code == 201
        made = httpx.put(f"{ds}/events/1", content=b"[1]", headers=JSON_TYPE)
        assert made.status_code == 201
        wait_until(lambda: len(receiver.bodies) == 1)
        first.stop(signal.SIGKILL, timeout=10)
        second = broker_processes(env)
        wait_until(lambda: len(receiver.bodies) == 2, timeout=15)  # after the 1 s lease
        old, new = receiver.bodies
        assert (old["generation"], new["generation"]) == (1, 2)
        assert old["streams"] == new["streams"]
        callback = new["callback_url"].replace(first.base_url, second.base_url)
        for wake, status in ((old, 409), (new, 200)):
            ack = {
                "wake_id": wake["wake_id"],
                "generation": wake["generation"],
                "acks": [{"stream": "events/1", "offset": wake["streams"][0]["tail_offset"]}],
                "done": True,
            }
            sent = httpx.post(callback, json=ack, headers=bearer(wake["callback_token"]))
            assert sent.status_code == status, sent.text
    finally:
        receiver.close()


async def test_a_tenant_holds_a_bounded_number_of_subscriptions(subs: Subscriptions) -> None:
    """Every append walks its tenant's subscriptions in its script: they are bounded."""
    config = parse_config(PULL)
    for n in range(MAX_SUBSCRIPTIONS):
        assert await subs.put("t", f"s{n}", config, "http://broker/ds")
    with pytest.raises(TooManySubscriptions) as caught:
        await subs.put("t", "one-more", config, "http://broker/ds")
    assert (caught.value.status, caught.value.code) == (429, "subscription_quota")
    assert await subs.put("t", "s0", config, "http://broker/ds") is False  # found again: fine
    assert await subs.put("other", "one-more", config, "http://broker/ds")  # per tenant
    await subs.delete("t", "s0")
    assert await subs.put("t", "one-more", config, "http://broker/ds")


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:3000/x", True),
        ("http://localhost:3000/x", True),
        ("http://10.0.0.1:3000/x", False),
        ("http://169.254.169.254:3000/x", False),
    ],
)
def test_the_loopback_allowance_opens_loopback_only_for_a_turn_s_notify_url_too(
    url: str, allowed: bool
) -> None:
    hosts = parse_hosts("*:3000")
    config = WebhookConfig(b"k" * 32, None, {}, hosts, secured=True, allow_loopback=True)
    closed = WebhookConfig(b"k" * 32, None, {}, hosts, secured=True)
    assert (config.url_refusal(urllib.parse.urlsplit(url)) is None) is allowed
    assert closed.url_refusal(urllib.parse.urlsplit(url)) is not None


async def test_every_process_signs_with_the_key_in_redis_and_follows_a_new_one(
    aredis: Redis, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, hub = await _made(aredis, clock)
    other, other_hub = await _made(aredis, clock, one._prefix)
    first = await one.signer()
    assert (await other.signer()).kid == first.kid  # made once, shared
    await aredis.delete(f"{one._prefix}:{{ds:subs}}:signing")  # a flushed Redis
    assert (await one.signer()).kid == first.kid  # read again only now and then
    monkeypatch.setattr(subscriptions_module, "SIGNER_CHECK_S", -1.0)
    renewed = await one.signer()
    assert renewed.kid != first.kid
    assert (await other.signer()).kid == renewed.kid
    await hub.close()
    await other_hub.close()
