"""Durable Streams' own streams: each tenant's key space, its quotas (streams, bytes, append
rate), forks that copy nothing, and the bad input that once gave a 500 (issue 34, findings 2,
4 and 6)."""

from __future__ import annotations

import datetime
import itertools
import os

import httpx
import pytest
import redis

from broker.dialects.durable import wire
from broker.durable_store import protocol
from broker.durable_store.keys import KeySpace, ds_digest
from broker.settings import Settings, SettingsError
from tests.conftest import BrokerFactory
from tests.helpers import bearer, wait_until

TEXT = {"content-type": "text/plain"}
KEY_A = "key-acme-0123456789abcdef"
_prefixes = itertools.count()


def _stream(base_url: str, path: str) -> str:
    return f"{base_url}/ds/v1/stream/{path}"


# --- finding 2: a tenant's paths and an open broker's never meet ---------------------------


@pytest.mark.parametrize(
    ("tenant", "path", "other_tenant", "other_path"),
    [
        ("a", "notes", None, "a/notes"),  # the open broker's path that once was a's stream
        (None, "notes", "a", "notes"),
        ("a", "b/notes", "a/b", "notes"),  # (no tenant holds "/", but no path may forge one)
        ("a", "}:s:x", "a}:s:x", ""),
        ("a", "x", "b", "x"),
    ],
)
def test_no_path_names_another_tenants_stream(
    tenant: str | None, path: str, other_tenant: str | None, other_path: str
) -> None:
    keys = KeySpace("broker")
    mine = {keys.meta(tenant, path), keys.data(tenant, path), keys.streams(tenant)}
    theirs = {
        keys.meta(other_tenant, other_path),
        keys.data(other_tenant, other_path),
        keys.streams(other_tenant),
    }
    assert not mine & theirs
    # Every key of a tenant's streams is in its space (its slot), whatever the path holds.
    assert keys.meta(tenant, path).startswith(keys.space(tenant) + ":")
    assert keys.space(tenant) != keys.space(other_tenant)


def test_an_open_broker_on_the_same_redis_cannot_reach_a_tenants_streams(
    broker_factory: BrokerFactory,
) -> None:
    """Regression (issue 34, finding 2): an open broker's path ``a/notes`` was tenant a's
    ``notes``: it read, appended to and forked it."""
    prefix = f"shared{os.getpid()}-{next(_prefixes)}"
    secured = broker_factory(key_prefix=prefix, api_keys=f"a={KEY_A}")
    open_ = broker_factory(key_prefix=prefix)
    made = httpx.put(
        _stream(secured.base_url, "notes"), content=b"a's", headers=TEXT | bearer(KEY_A)
    )
    assert made.status_code == 201
    theirs = _stream(open_.base_url, "a/notes")
    assert httpx.get(theirs).status_code == 404
    assert httpx.head(theirs).status_code == 404
    assert httpx.post(theirs, content=b"!", headers=TEXT).status_code == 404
    fork = httpx.put(
        _stream(open_.base_url, "copy"),
        headers={"stream-forked-from": "/ds/v1/stream/a/notes"},
    )
    assert fork.status_code == 404
    # The open broker's own a/notes is a stream of its own: a's is untouched.
    assert httpx.put(theirs, content=b"open's", headers=TEXT).status_code == 201
    mine = httpx.get(_stream(secured.base_url, "notes"), headers=bearer(KEY_A))
    assert mine.text == "a's"
    assert httpx.get(theirs).text == "open's"


# --- finding 4: quotas ---------------------------------------------------------------------


def _refusal(response: httpx.Response, code: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"]


def test_a_tenant_holds_at_most_its_streams_and_deleting_or_expiry_gives_them_back(
    broker_factory: BrokerFactory,
) -> None:
    """Regression (issue 34, finding 4): 3,000 streams were created with no 429."""
    broker = broker_factory(ds_tenant_max_streams=2)
    base = broker.base_url
    assert httpx.put(_stream(base, "one"), headers=TEXT).status_code == 201
    assert httpx.put(_stream(base, "two"), headers=TEXT).status_code == 201
    refused = httpx.put(_stream(base, "three"), headers=TEXT)
    _refusal(refused, "stream_quota")
    assert "retry-after" not in refused.headers  # waiting does not help: deleting does
    assert httpx.get(_stream(base, "three")).status_code == 404  # nothing half-made
    assert httpx.put(_stream(base, "one"), headers=TEXT).status_code == 200  # the same one
    assert broker.metric("broker_ds_refusals_total", '{limit="streams"}') == 1
    assert httpx.delete(_stream(base, "one")).status_code == 204
    assert httpx.put(_stream(base, "three"), headers=TEXT).status_code == 201
    # A stream whose expiry passed gives its place back (the time is Redis's: already past).
    past = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)).isoformat()
    assert httpx.delete(_stream(base, "two")).status_code == 204
    expired = httpx.put(_stream(base, "old"), headers=TEXT | {"stream-expires-at": past})
    assert expired.status_code == 201
    assert httpx.get(_stream(base, "old")).status_code == 404
    assert httpx.put(_stream(base, "four"), headers=TEXT).status_code == 201


def test_quotas_are_each_tenants_own(broker_factory: BrokerFactory) -> None:
    key_b = "key-beta-0123456789abcdef"
    broker = broker_factory(api_keys=f"a={KEY_A},b={key_b}", ds_tenant_max_streams=1)
    base = broker.base_url
    assert httpx.put(_stream(base, "x"), headers=TEXT | bearer(KEY_A)).status_code == 201
    _refusal(httpx.put(_stream(base, "y"), headers=TEXT | bearer(KEY_A)), "stream_quota")
    assert httpx.put(_stream(base, "y"), headers=TEXT | bearer(key_b)).status_code == 201


def test_a_sliding_ttl_gives_its_stream_back_once_it_lapses(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(ds_tenant_max_streams=1)
    base = broker.base_url
    assert httpx.put(_stream(base, "brief"), headers=TEXT | {"stream-ttl": "1"}).status_code == 201
    _refusal(httpx.put(_stream(base, "next"), headers=TEXT), "stream_quota")
    # Once its TTL lapsed (and the two seconds the accounting leaves the keys to go), the
    # tenant's place is free again, without any delete.
    made = wait_until(
        lambda: httpx.put(_stream(base, "next"), headers=TEXT).status_code == 201,
        timeout=15,
        interval=0.1,
    )
    assert made


def test_a_read_moves_a_sliding_ttl_in_the_accounting_never_before_the_keys_expiry(
    broker_factory: BrokerFactory, raw_redis: redis.Redis
) -> None:
    """A stream's score is when its share comes back: a read that starts its TTL again moves
    it, and it is never before the keys' own expiry (or a live stream would be given back)."""
    broker = broker_factory()
    url = _stream(broker.base_url, "kept")
    assert httpx.put(url, headers=TEXT | {"stream-ttl": "600"}).status_code == 201
    keys = KeySpace(broker.settings.key_prefix)

    def score() -> float:
        value = raw_redis.zscore(keys.streams(None), ds_digest("kept"))
        assert value is not None
        assert value >= raw_redis.pexpiretime(keys.meta(None, "kept"))
        return value

    first = score()
    assert wait_until(lambda: httpx.get(url).status_code == 200 and score() > first, timeout=5)


def test_a_tenants_bytes_are_bounded_and_a_fork_is_charged_what_it_adds(
    broker_factory: BrokerFactory,
) -> None:
    """A fork reads what it inherits from its source: it is charged what it adds, and a source
    deleted while forks read it keeps its share until its last fork goes (its bytes are still
    in Redis). Regression (issue 34, finding 4): a ~200-byte fork of an 8 MiB stream added
    8.3 MiB."""
    broker = broker_factory(ds_tenant_max_bytes=1_000)
    base = broker.base_url
    source = _stream(base, "source")
    assert httpx.put(source, content=b"x" * 600, headers=TEXT).status_code == 201
    _refusal(httpx.post(source, content=b"y" * 500, headers=TEXT), "byte_quota")
    assert httpx.post(source, content=b"y" * 300, headers=TEXT).status_code == 204
    fork = _stream(base, "fork")
    made = httpx.put(
        fork, content=b"f" * 50, headers={"stream-forked-from": "/ds/v1/stream/source"}
    )
    assert made.status_code == 201, made.text  # 50 bytes of its own, 900 read from its source
    assert httpx.get(fork).content == b"x" * 600 + b"y" * 300 + b"f" * 50
    assert broker.metric("broker_ds_refusals_total", '{limit="bytes"}') == 1
    _refusal(httpx.post(fork, content=b"g" * 51, headers=TEXT), "byte_quota")
    assert httpx.post(fork, content=b"g" * 50, headers=TEXT).status_code == 204
    # The source deleted while its fork reads it: still charged.
    assert httpx.delete(source).status_code == 204
    assert httpx.get(source).status_code == 410
    _refusal(httpx.put(_stream(base, "other"), content=b"z", headers=TEXT), "byte_quota")
    # Its last fork gone, it goes too, and gives its share back with the fork's.
    assert httpx.delete(fork).status_code == 204
    assert httpx.get(source).status_code == 404
    again = httpx.put(_stream(base, "again"), content=b"z" * 1_000, headers=TEXT)
    assert again.status_code == 201


def test_a_tenant_appending_faster_than_its_rate_gets_429_with_retry_after(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(ds_tenant_appends_per_s=0.5, ds_tenant_append_burst=3)
    url = _stream(broker.base_url, "fast")
    assert httpx.put(url, headers=TEXT).status_code == 201
    assert httpx.post(url, content=b"1", headers=TEXT).status_code == 204
    assert httpx.post(url, content=b"2", headers=TEXT).status_code == 204
    refused = httpx.post(url, content=b"3", headers=TEXT)
    _refusal(refused, "rate_limited")
    assert 1 <= int(refused.headers["retry-after"]) <= 2
    assert httpx.get(url).text == "12"  # the refused append did nothing
    assert broker.metric("broker_ds_refusals_total", '{limit="rate"}') == 1


def _net_out(client: redis.Redis) -> int:
    if isinstance(client, redis.RedisCluster):
        per_node = client.info("stats", target_nodes=redis.RedisCluster.PRIMARIES)
        return sum(int(stats["total_net_output_bytes"]) for stats in per_node.values())
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_fork_copies_nothing_in_redis_or_through_the_broker(
    broker_factory: BrokerFactory, raw_redis: redis.Redis
) -> None:
    """A fork of a 4 MiB stream records its source and point: Redis sends the broker nothing
    of it, and it adds a few hundred bytes, not 4 MiB. Regression (issue 34, finding 4): a fork
    of a 48 MiB stream read it all into the broker (RSS from 106 to 199 MiB)."""
    broker = broker_factory()
    source = _stream(broker.base_url, "big")
    chunk = b"z" * 262_144
    assert httpx.put(source, content=chunk, headers=TEXT).status_code == 201
    for _ in range(15):
        assert httpx.post(source, content=chunk, headers=TEXT).status_code == 204
    before = _net_out(raw_redis)
    fork = httpx.put(
        _stream(broker.base_url, "big-fork"), headers={"stream-forked-from": "/ds/v1/stream/big"}
    )
    assert fork.status_code == 201
    sent = _net_out(raw_redis) - before
    assert sent < 262_144, f"Redis sent {sent} bytes for a fork of 4 MiB"
    keys = KeySpace(broker.settings.key_prefix)
    added = sum(
        raw_redis.memory_usage(key, samples=0) or 0
        for key in (keys.meta(None, "big-fork"), keys.data(None, "big-fork"))
    )
    assert added < 65_536, f"a fork of 4 MiB added {added} bytes"
    assert fork.headers["stream-next-offset"] == httpx.head(source).headers["stream-next-offset"]
    assert len(httpx.get(_stream(broker.base_url, "big-fork"), timeout=30).content) == 16 * 262_144


# --- finding 6: bad input is a 400, never a 500, and nothing is half-done --------------------


@pytest.mark.parametrize(
    ("body", "limit", "within"),
    [
        (b"[]", 1, True),
        (b"[[]]", 1, False),
        (b'["[[[["]', 1, True),  # brackets in strings do not count
        (b'["\\"[[", {}]', 1, False),  # an escaped quote does not end the string
        (b'{"a": {"b": [1, 2]}}', 3, True),
        (b'{"a": {"b": [1, 2]}}', 2, False),
        (b"[" * 128 + b"]" * 128, 128, True),
        (b"[" * 129 + b"]" * 129, 128, False),
    ],
)
def test_json_depth(body: bytes, limit: int, within: bool) -> None:
    assert protocol.json_depth(body, limit) is within


@pytest.mark.parametrize("depth", [129, 1_000, 1_100])
def test_a_json_body_nested_too_deep_is_a_400(broker_factory: BrokerFactory, depth: int) -> None:
    """Regression (issue 34, finding 6): JSON nested 1,000 deep gave a 500 (the fallback
    encoder recursed)."""
    broker = broker_factory()
    url = _stream(broker.base_url, f"deep-{depth}")
    json_type = {"content-type": "application/json"}
    deep = b"[" * depth + b"]" * depth
    made = httpx.put(url, content=deep, headers=json_type)
    assert made.status_code == 400
    assert made.json()["error"]["code"] == "json_too_deep"
    assert httpx.get(url).status_code == 404  # nothing made
    assert httpx.put(url, headers=json_type).status_code == 201
    for body in (deep, b"[" * depth + b'"]]"' + b"]" * depth):  # a string's brackets aside
        appended = httpx.post(url, content=body, headers=json_type)
        assert appended.status_code == 400
        assert appended.json()["error"]["code"] == "json_too_deep"
    assert httpx.get(url).json() == []
    fine = b"[" * 128 + b"]" * 128
    assert httpx.post(url, content=fine, headers=json_type).status_code == 204


@pytest.mark.parametrize(
    ("path", "quoted"),
    [
        ("notes", "notes"),
        ("a/b", "a/b"),
        ("café/✓", "caf%C3%A9/%E2%9C%93"),
        ("what?#%", "what%3F%23%25"),
        ("sp ace", "sp%20ace"),
        ("k=v;x:y@z~-._!$&'()*+,", "k=v;x:y@z~-._!$&'()*+,"),
    ],
)
def test_a_path_is_quoted_as_rfc_3986_says(path: str, quoted: str) -> None:
    assert wire.quote_path(path) == quoted


def test_a_path_outside_latin_1_is_created_once_with_its_location(
    broker_factory: BrokerFactory,
) -> None:
    """Regression (issue 34, finding 6): the stream was made, then its Location could not be
    encoded: the first PUT was a 500, its retry a 200."""
    broker = broker_factory()
    url = f"{broker.base_url}/ds/v1/stream/caf%C3%A9/%E2%9C%93%3F"
    made = httpx.put(url, content=b"hi", headers=TEXT)
    assert made.status_code == 201
    location = made.headers["location"]
    assert location == url
    assert httpx.get(location).text == "hi"
    assert httpx.put(url, content=b"hi", headers=TEXT).status_code == 200


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BROKER_DS_TENANT_MAX_STREAMS": "-1"}, "BROKER_DS_TENANT_MAX_STREAMS must be 0"),
        ({"BROKER_DS_TENANT_MAX_BYTES": "lots"}, "BROKER_DS_TENANT_MAX_BYTES must be a whole"),
        ({"BROKER_DS_TENANT_APPENDS_PER_S": "-5"}, "BROKER_DS_TENANT_APPENDS_PER_S must be 0"),
        ({"BROKER_DS_TENANT_APPEND_BURST": "0"}, "BROKER_DS_TENANT_APPEND_BURST must be at least"),
    ],
)
def test_bad_quota_settings_stop_the_broker_naming_the_variable(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_the_quotas_are_on_by_default() -> None:
    settings = Settings.from_env({})
    assert settings.ds_tenant_max_streams > 0
    assert settings.ds_tenant_max_bytes > 0
    assert settings.ds_tenant_appends_per_s > 0
    assert Settings.from_env({"BROKER_DS_TENANT_APPENDS_PER_S": "0"}).ds_tenant_appends_per_s == 0
