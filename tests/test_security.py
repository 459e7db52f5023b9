"""Security: credentials, tenant isolation, attach tokens, limits, CORS and page headers."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from broker.auth import parse_api_keys
from broker.settings import Settings, SettingsError
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import (
    bearer,
    get_turn,
    read_sse,
    start_turn,
    text_of,
    wait_final,
    wait_until,
)

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

KEY_A = "key-acme-0123456789abcdef"
KEY_B = "key-globex-0123456789abcdef"
JWT_SECRET = "jwt-secret-" + "j" * 32
ATTACH_SECRET = "attach-secret-" + "a" * 32
USER = [{"role": "user", "content": "hello"}]


def secured(factory: BrokerFactory, **overrides: Any) -> RunningBroker:
    values: dict[str, Any] = {
        "api_keys": f"acme={KEY_A},globex={KEY_B}",
        "jwt_secret": JWT_SECRET,
        "attach_secret": ATTACH_SECRET,
    }
    values.update(overrides)
    return factory(**values)


def call(
    broker: RunningBroker, method: str, path: str, auth: str | None = None, **kwargs: Any
) -> httpx.Response:
    headers = {**bearer(auth), **kwargs.pop("headers", {})}
    return httpx.request(method, f"{broker.base_url}{path}", headers=headers, timeout=10, **kwargs)


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


def user_jwt(claims: dict[str, Any], key: Any = JWT_SECRET, algorithm: str = "HS256") -> str:
    return jwt.encode({"exp": int(time.time()) + 300, **claims}, key, algorithm=algorithm)


# --- authentication -------------------------------------------------------------------------


def test_an_open_broker_says_so_loudly_and_a_secured_one_does_not(
    broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="broker"):
        broker_factory()
    assert "AUTHENTICATION IS OFF" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker"):
        secured(broker_factory)
    assert "AUTHENTICATION IS OFF" not in caplog.text


def test_without_credentials_every_api_route_is_401_but_health_stays_open(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    routes: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/turns", {"json": {"conversation_id": "c", "messages": USER}}),
        ("GET", "/v1/turns/t1", {}),
        ("POST", "/v1/turns/t1/cancel", {}),
        ("POST", "/v1/turns/t1/attempts", {"json": {"strategy": "regenerate"}}),
        ("POST", "/v1/turns/t1/attach-tokens", {}),
        ("GET", "/v1/turns/t1/tool-calls", {}),
        ("GET", "/v1/conversations/c/messages", {}),
        ("GET", f"/v1/streams/st_{'0' * 32}", {}),
    ]
    for method, path, kwargs in routes:
        response = call(broker, method, path, **kwargs)
        assert response.status_code == 401, (path, response.text)
        assert error_code(response) == "unauthorized"
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert call(broker, "GET", "/healthz").status_code == 200
    assert call(broker, "GET", "/metrics").status_code == 200
    assert broker.metric("broker_auth_failures_total", '{reason="missing"}') == len(routes)


def test_unknown_keys_and_other_schemes_are_401(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory)
    for header in (f"Bearer {KEY_A}x", f"Basic {KEY_A}", "Bearer", "Bearer a.b.c"):
        response = call(broker, "GET", "/v1/turns/t1", headers={"Authorization": header})
        assert response.status_code == 401, header
    assert call(broker, "GET", "/v1/turns/t1", KEY_A).status_code == 404  # known key: in


def test_metrics_can_be_protected_separately(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(metrics_token="metrics-token-0123456789")
    assert call(broker, "GET", "/metrics").status_code == 401
    assert call(broker, "GET", "/metrics", "wrong").status_code == 401
    response = call(broker, "GET", "/metrics", "metrics-token-0123456789")
    assert response.status_code == 200
    assert "broker_turns_started_total" in response.text
    assert call(broker, "GET", "/healthz").status_code == 200


def test_api_keys_from_a_file(broker_factory: BrokerFactory, tmp_path: Any) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# tenants\nacme={KEY_A}\n\nglobex={KEY_B}\n")
    broker = broker_factory(api_keys_file=str(path))
    turn = start_turn(broker.base_url, "c", auth=KEY_B, tokens=3)
    assert wait_final(broker.base_url, turn["turn_id"], auth=KEY_B)["status"] == "complete"
    assert call(broker, "GET", f"/v1/turns/{turn['turn_id']}", KEY_A).status_code == 404


def test_hs256_jwts_name_the_tenant_by_their_claim(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory)
    token = user_jwt({"sub": "acme"})
    turn = start_turn(broker.base_url, "c", auth=token, tokens=3)
    # The same tenant through an API key sees the turn; another tenant does not.
    assert get_turn(broker.base_url, turn["turn_id"], KEY_A)["status"] in (
        "queued",
        "streaming",
        "complete",
    )
    assert call(broker, "GET", f"/v1/turns/{turn['turn_id']}", KEY_B).status_code == 404

    # Any audience is fine while BROKER_JWT_AUDIENCE is unset; IdP-style subjects are tenants.
    with_aud = user_jwt({"sub": "acme", "aud": "some-api"})
    assert call(broker, "GET", f"/v1/turns/{turn['turn_id']}", with_aud).status_code == 200
    idp = user_jwt({"sub": "auth0|5f3a@example.com"})
    assert call(broker, "GET", f"/v1/turns/{turn['turn_id']}", idp).status_code == 404
    expired = user_jwt({"sub": "acme", "exp": int(time.time()) - 120})
    forged = user_jwt({"sub": "acme"}, key="another-secret-" + "x" * 32)
    no_claim = user_jwt({"name": "acme"})
    bad_tenant = user_jwt({"sub": "acme/evil"})
    for credential, code in (
        (expired, "token_expired"),
        (forged, "bad_token"),
        (no_claim, "bad_token"),
        (bad_tenant, "bad_token"),
    ):
        response = call(broker, "GET", f"/v1/turns/{turn['turn_id']}", credential)
        assert response.status_code == 401, response.text
        assert error_code(response) == code


def test_rs256_jwts_are_checked_with_the_public_key(
    broker_factory: BrokerFactory, tmp_path: Any
) -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "jwt.pem").write_bytes(pem)
    broker = broker_factory(
        jwt_public_key=str(tmp_path / "jwt.pem"), jwt_tenant_claim="org", jwt_audience="broker"
    )
    good = user_jwt({"org": "acme", "aud": "broker"}, private, "RS256")
    assert call(broker, "GET", "/v1/turns/t1", good).status_code == 404  # in, nothing there
    for token in (
        user_jwt({"org": "acme", "aud": "broker"}, other, "RS256"),  # wrong key
        user_jwt({"org": "acme", "aud": "elsewhere"}, private, "RS256"),  # wrong audience
        user_jwt({"org": "acme", "aud": "broker"}, JWT_SECRET, "HS256"),  # algorithm swap
    ):
        assert call(broker, "GET", "/v1/turns/t1", token).status_code == 401


# --- tenant isolation -----------------------------------------------------------------------


def test_another_tenants_turn_is_not_found_by_any_route(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory)
    turn = start_turn(
        broker.base_url, "shared-conv", turn_id="shared-turn", auth=KEY_A, tokens=4, seed=1
    )
    wait_final(broker.base_url, "shared-turn", auth=KEY_A)
    stream = f"/v1/streams/{turn['stream_id']}"
    probes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/turns/{}", {}),
        ("POST", "/v1/turns/{}/cancel", {}),
        ("POST", "/v1/turns/{}/attempts", {"json": {"strategy": "regenerate"}}),
        ("POST", "/v1/turns/{}/canonical", {"json": {"attempt": 1}}),
        ("POST", "/v1/turns/{}/attach-tokens", {}),
        ("GET", "/v1/turns/{}/tool-calls", {}),
    ]
    for method, path, kwargs in probes:
        theirs = call(broker, method, path.format("shared-turn"), KEY_B, **kwargs)
        unknown = call(broker, method, path.format("no-such-turn"), KEY_B, **kwargs)
        assert theirs.status_code == unknown.status_code == 404, (path, theirs.text)
        assert theirs.json()["error"]["message"].replace("shared-turn", "X") == (
            unknown.json()["error"]["message"].replace("no-such-turn", "X")
        )
    assert call(broker, "GET", "/v1/conversations/shared-conv/messages", KEY_B).status_code == 404
    for params in ({}, {"format": "json"}, {"offset": "now"}):
        assert call(broker, "GET", stream, KEY_B, params=params).status_code == 404
    # Nothing changed for the owner: still complete, one attempt, and the stream reads whole.
    state = get_turn(broker.base_url, "shared-turn", KEY_A)
    assert state["status"] == "complete"
    assert state["attempt"] == 1
    assert text_of(read_sse(broker.base_url, turn["stream_id"], auth=KEY_A).events)


def test_tenants_may_use_the_same_ids_without_meeting(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory)
    a = start_turn(
        broker.base_url, "conv", turn_id="turn-1", prompt="from acme", auth=KEY_A, tokens=5, seed=1
    )
    b = start_turn(
        broker.base_url,
        "conv",
        turn_id="turn-1",
        prompt="from globex",
        auth=KEY_B,
        tokens=5,
        seed=2,
    )
    assert a["stream_id"] != b["stream_id"]
    assert a["conversation_id"] == b["conversation_id"] == "conv"
    wait_final(broker.base_url, "turn-1", auth=KEY_A)
    wait_final(broker.base_url, "turn-1", auth=KEY_B)
    history_a = call(broker, "GET", "/v1/conversations/conv/messages", KEY_A).json()
    history_b = call(broker, "GET", "/v1/conversations/conv/messages", KEY_B).json()
    assert history_a["messages"][0]["content"] == "from acme"
    assert history_b["messages"][0]["content"] == "from globex"
    assert history_a["conversation_id"] == "conv"


# --- attach tokens --------------------------------------------------------------------------


def mint(
    broker: RunningBroker, turn_id: str, auth: str | None = KEY_A, **body: Any
) -> dict[str, Any]:
    response = call(broker, "POST", f"/v1/turns/{turn_id}/attach-tokens", auth, json=body)
    assert response.status_code == 201, response.text
    minted: dict[str, Any] = response.json()
    return minted


def test_an_attach_token_reads_its_stream_by_query_or_header(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=12, seed=5)
    minted = mint(broker, turn["turn_id"], ttl_s=60)
    assert minted["stream_id"] == turn["stream_id"]
    assert minted["expires_at"] - time.time() == pytest.approx(60, abs=5)
    assert minted["links"]["stream"] == f"/v1/streams/{turn['stream_id']}?token={minted['token']}"
    owner = text_of(read_sse(broker.base_url, turn["stream_id"], auth=KEY_A).events)
    by_query = read_sse(broker.base_url, turn["stream_id"], token=minted["token"])
    by_header = read_sse(broker.base_url, turn["stream_id"], auth=minted["token"])
    assert text_of(by_query.events) == text_of(by_header.events) == owner != ""
    page = call(
        broker,
        "GET",
        f"/v1/streams/{turn['stream_id']}",
        params={"format": "json", "token": minted["token"]},
    )
    assert page.status_code == 200
    assert page.json()["closed"] is True


def test_attach_tokens_that_are_forged_expired_or_for_another_stream_are_refused(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    first = start_turn(broker.base_url, "c", auth=KEY_A, tokens=3)
    second = start_turn(broker.base_url, "c", auth=KEY_A, tokens=3)
    token = mint(broker, first["turn_id"])["token"]
    claims = jwt.decode(token, ATTACH_SECRET, algorithms=["HS256"], audience="broker-attach")
    forged = jwt.encode(claims, "not-the-secret-" + "z" * 32, algorithm="HS256")
    expired = jwt.encode({**claims, "exp": int(time.time()) - 60}, ATTACH_SECRET, "HS256")
    other_tenant_stream = start_turn(broker.base_url, "c", auth=KEY_B, tokens=3)["stream_id"]
    cases = [
        (first["stream_id"], forged, 401, "bad_token"),
        (first["stream_id"], token[:-3] + "AAA", 401, "bad_token"),
        (first["stream_id"], expired, 401, "token_expired"),
        (second["stream_id"], token, 403, "wrong_stream"),
        (other_tenant_stream, token, 403, "wrong_stream"),
    ]
    for stream_id, credential, status, code in cases:
        response = call(broker, "GET", f"/v1/streams/{stream_id}", params={"token": credential})
        assert response.status_code == status, (code, response.text)
        assert error_code(response) == code


def test_an_attach_token_cannot_start_cancel_or_retry_anything(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=200, tokens_per_s=50)
    token = mint(broker, turn["turn_id"])["token"]
    tid = turn["turn_id"]
    actions: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", f"/v1/turns/{tid}/cancel", {}),
        ("POST", f"/v1/turns/{tid}/attempts", {"json": {"strategy": "regenerate"}}),
        ("POST", f"/v1/turns/{tid}/canonical", {"json": {"attempt": 1}}),
        ("POST", f"/v1/turns/{tid}/attach-tokens", {}),
        ("POST", "/v1/turns", {"json": {"conversation_id": "c", "messages": USER}}),
        ("GET", f"/v1/turns/{tid}", {}),
        ("GET", "/v1/conversations/c/messages", {}),
    ]
    for method, path, kwargs in actions:
        for how in ("header", "query"):
            if how == "header":
                response = call(broker, method, path, token, **kwargs)
            else:
                response = call(broker, method, path, params={"token": token}, **kwargs)
            assert response.status_code == 403, (path, how, response.text)
            assert error_code(response) == "read_only"
    assert get_turn(broker.base_url, tid, KEY_A)["status"] in ("queued", "streaming")
    call(broker, "POST", f"/v1/turns/{tid}/cancel", KEY_A)
    assert wait_final(broker.base_url, tid, auth=KEY_A)["status"] == "cancelled"


def test_a_one_viewer_tokens_newest_connection_takes_over_and_the_older_one_ends(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.viewer.VIEWER_LEASE_MS", 900)  # renewed every 0.3 s
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=400, tokens_per_s=40)
    token = mint(broker, turn["turn_id"], one_viewer=True)["token"]
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    opened = threading.Event()
    first_lines: list[str] = []
    first_ended = threading.Event()

    def first_viewer() -> None:
        with httpx.stream("GET", url, params={"token": token}, timeout=20) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                first_lines.append(line)
                opened.set()
        first_ended.set()  # the server ended it

    thread = threading.Thread(target=first_viewer, daemon=True)
    thread.start()
    assert opened.wait(10)
    # A phone back on a new network: its new connection is admitted while the old one lives.
    with httpx.stream("GET", url, params={"token": token}, timeout=20) as second:
        assert second.status_code == 200
        lines = second.iter_lines()
        assert next(line for line in lines if line == "event: delta")
        # The older connection ends at its next frame once its renewal finds the lock gone,
        # long before the answer's own end.
        assert first_ended.wait(10), "the older connection went on reading"
    thread.join(10)
    assert "event: end" not in first_lines
    assert httpx.get(url, params={"token": token, "format": "json"}, timeout=10).status_code == 403
    call(broker, "POST", f"/v1/turns/{turn['turn_id']}/cancel", KEY_A)


def test_a_viewer_whose_lock_changed_hands_is_let_go(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch, raw_redis: Any
) -> None:
    monkeypatch.setattr("broker.viewer.VIEWER_LEASE_MS", 600)  # renewed every 0.2 s
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=3000, tokens_per_s=50)
    token = mint(broker, turn["turn_id"], one_viewer=True)["token"]
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    deltas = 0
    with httpx.stream("GET", url, params={"token": token}, timeout=20) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while deltas < 3:
            deltas += next(lines) == "event: delta"
        # The lock is someone else's now (its lease ran out behind this connection, say):
        # the connection is ended at its next frame, long before the answer's own end.
        (key,) = raw_redis.scan_iter(match=f"{broker.settings.key_prefix}:*:viewer:*")
        raw_redis.set(key, "another-holder", px=60_000)
        deadline = time.monotonic() + 10
        rest = []
        for line in lines:
            rest.append(line)
            assert time.monotonic() < deadline, "the stream went on after its lock was lost"
    assert "event: end" not in rest
    call(broker, "POST", f"/v1/turns/{turn['turn_id']}/cancel", KEY_A)


def test_attach_tokens_work_on_an_open_broker_too(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "c", tokens=5, seed=2)
    minted = mint(broker, turn["turn_id"], auth="anything")
    read = read_sse(broker.base_url, turn["stream_id"], token=minted["token"])
    assert text_of(read.events) == text_of(read_sse(broker.base_url, turn["stream_id"]).events)
    # A share link keeps its limits even here: its token is checked and scoped.
    other = start_turn(broker.base_url, "c", tokens=2)
    wrong = call(
        broker, "GET", f"/v1/streams/{other['stream_id']}", params={"token": minted["token"]}
    )
    assert wrong.status_code == 403
    forged = call(
        broker,
        "GET",
        f"/v1/streams/{turn['stream_id']}",
        params={"token": minted["token"][:-4] + "AAAA"},
    )
    assert forged.status_code == 401


# --- limits ---------------------------------------------------------------------------------


def test_turn_creation_is_rate_limited_per_tenant_with_retry_after(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory, turn_rate_per_s=0.2, turn_burst=2)
    for n in range(2):
        start_turn(broker.base_url, "c", turn_id=f"ok-{n}", auth=KEY_A, tokens=2)
    refused = call(
        broker,
        "POST",
        "/v1/turns",
        KEY_A,
        json={"conversation_id": "c", "turn_id": "late", "messages": USER},
    )
    assert refused.status_code == 429
    assert error_code(refused) == "rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 5
    # A repeated request for an existing turn is a lookup, not a new turn: it is not charged.
    again = start_turn(broker.base_url, "c", turn_id="ok-0", auth=KEY_A, tokens=2, expect=200)
    assert again["turn_id"] == "ok-0"
    # A new attempt is a generation too: it is charged like a new turn.
    wait_final(broker.base_url, "ok-0", auth=KEY_A)
    retry = call(broker, "POST", "/v1/turns/ok-0/attempts", KEY_A, json={"strategy": "regenerate"})
    assert retry.status_code == 429
    assert error_code(retry) == "rate_limited"
    # Other tenants have buckets of their own.
    start_turn(broker.base_url, "c", turn_id="theirs", auth=KEY_B, tokens=2, expect=201)
    assert broker.metric("broker_turns_refused_total", '{reason="rate"}') == 2
    # The refused turn was not created.
    assert call(broker, "GET", "/v1/turns/late", KEY_A).status_code == 404


def test_live_streams_per_tenant_are_capped_and_freed_when_turns_end(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory, max_streams_per_tenant=2)
    slow = [
        start_turn(
            broker.base_url, "c", turn_id=f"slow-{n}", auth=KEY_A, tokens=500, tokens_per_s=20
        )
        for n in range(2)
    ]
    body = {
        "conversation_id": "c",
        "turn_id": "third",
        "messages": USER,
        "params": {"simulate": {"tokens": 2}},
    }
    refused = call(broker, "POST", "/v1/turns", KEY_A, json=body)
    assert refused.status_code == 429
    assert error_code(refused) == "too_many_streams"
    assert refused.headers["retry-after"] == "1"
    start_turn(broker.base_url, "c", turn_id="other", auth=KEY_B, tokens=2, expect=201)
    call(broker, "POST", f"/v1/turns/{slow[0]['turn_id']}/cancel", KEY_A)
    wait_final(broker.base_url, slow[0]["turn_id"], auth=KEY_A)
    wait_until(
        lambda: call(broker, "POST", "/v1/turns", KEY_A, json=body).status_code == 201,
        timeout=10,
        interval=0.05,
    )
    # A new attempt of a finished turn needs a slot too; the cap is full again (slow-1, third
    # may still run), so wait for the short one to finish first.
    wait_final(broker.base_url, "third", auth=KEY_A)
    response = call(
        broker, "POST", "/v1/turns/third/attempts", KEY_A, json={"strategy": "regenerate"}
    )
    assert response.status_code == 201, response.text
    call(broker, "POST", f"/v1/turns/{slow[1]['turn_id']}/cancel", KEY_A)


def test_oversized_headers_are_431_and_bad_ids_and_offsets_are_400(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory, max_header_bytes=4096)
    response = call(broker, "GET", "/v1/turns/t1", KEY_A, headers={"X-Filler": "x" * 5000})
    assert response.status_code == 431
    assert error_code(response) == "headers_too_large"
    long_query = call(broker, "GET", "/v1/turns/t1", KEY_A, params={"q": "y" * 5000})
    assert long_query.status_code == 431
    bad_ids = [
        {"conversation_id": "has space", "messages": USER},
        {"conversation_id": "c", "turn_id": "a/b", "messages": USER},
        {"conversation_id": "x" * 200, "messages": USER},
    ]
    for body in bad_ids:
        assert call(broker, "POST", "/v1/turns", KEY_A, json=body).status_code == 400
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=2)
    for offset in ("12", "abc", "-2", "0000000000000001-x"):
        response = call(
            broker, "GET", f"/v1/streams/{turn['stream_id']}", KEY_A, params={"offset": offset}
        )
        assert response.status_code == 400, offset
    bad_bodies: list[dict[str, Any]] = [
        {"ttl_s": -1},
        {"ttl_s": "soon"},
        {"one_viewer": "maybe"},
        {"other": 1},
    ]
    for body in bad_bodies:
        response = call(
            broker, "POST", f"/v1/turns/{turn['turn_id']}/attach-tokens", KEY_A, json=body
        )
        assert response.status_code == 400, body


# --- browser-facing headers -----------------------------------------------------------------


def test_the_demo_page_has_a_strict_policy_and_every_response_nosniff(
    broker: RunningBroker,
) -> None:
    page = call(broker, "GET", "/")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert page.headers["x-frame-options"] == "DENY"
    api = call(broker, "GET", "/v1/turns/nope")
    assert api.headers["x-content-type-options"] == "nosniff"
    assert api.headers["referrer-policy"] == "no-referrer"
    assert "content-security-policy" not in api.headers


def test_cors_answers_only_the_configured_origins(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory, cors_origins="https://app.example, https://other.example/")
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    allowed = call(broker, "OPTIONS", "/v1/turns", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    denied = call(
        broker, "OPTIONS", "/v1/turns", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in denied.headers
    limited = call(
        broker,
        "POST",
        "/v1/turns",
        headers={"Origin": "https://other.example"},
        json={"conversation_id": "c", "messages": USER},
    )
    assert limited.status_code == 401  # CORS is not authentication
    assert limited.headers["access-control-allow-origin"] == "https://other.example"
    plain = broker_factory()
    response = call(plain, "GET", "/healthz", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in response.headers


# --- robustness -----------------------------------------------------------------------------


def test_after_a_burst_of_bad_requests_a_normal_turn_is_served(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory, max_body_bytes=10_000, max_header_bytes=4096)
    base = broker.base_url
    stream = f"/v1/streams/st_{'0' * 32}"

    key = bearer(KEY_A)
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/turns", {"content": b"{not json", "headers": key}),
        ("POST", "/v1/turns", {"content": b"x" * 20_000, "headers": key}),
        ("GET", "/v1/turns/t", {"headers": {"Authorization": "Bearer nope"}}),
        ("GET", stream, {"params": {"offset": "bogus"}, "headers": key}),
        ("GET", "/v1/turns/t", {"headers": {"X-Big": "b" * 8000}}),
        ("GET", stream, {"params": {"token": "e30.e30.e30"}}),
        ("POST", "/v1/turns", {"json": {"conversation_id": "c", "messages": []}, "headers": key}),
        ("POST", "/v1/turns/%00/cancel", {"headers": key}),
    ]

    def bad(n: int) -> int:
        method, path, kwargs = requests[n % len(requests)]
        with httpx.Client(base_url=base, timeout=10) as client:
            return client.request(method, path, **kwargs).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(bad, range(200)))
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    turn = start_turn(base, "after-burst", auth=KEY_A, tokens=20, seed=9)
    assert wait_final(base, turn["turn_id"], auth=KEY_A)["status"] == "complete"
    assert len(text_of(read_sse(base, turn["stream_id"], auth=KEY_A).events)) > 0


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"api_keys": "acme=short"}, "shorter than 16"),
        ({"api_keys": "no-equals-sign-here-0123456789"}, "tenant=key"),
        ({"api_keys": f"acme/x={KEY_A}"}, "tenant=key"),
        ({"api_keys": f"acme={KEY_A},globex={KEY_A}"}, "two tenants"),
        ({"jwt_secret": "too-short"}, "at least 32"),
        ({"jwt_public_key": "/nonexistent/key.pem"}, "cannot read"),
    ],
)
def test_bad_security_settings_stop_the_start_with_one_clear_line(
    overrides: dict[str, str], fragment: str, tmp_path: Any
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    env.update({f"BROKER_{k.upper()}": v for k, v in overrides.items()})
    env["BROKER_PORT"] = "0"
    done = subprocess.run(
        [sys.executable, "-m", "broker", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert fragment in lines[0]


def test_conflicting_settings_are_refused() -> None:
    with pytest.raises(SettingsError, match="not both"):
        Settings(jwt_secret="j" * 40, jwt_public_key="/k.pem")
    with pytest.raises(SettingsError, match="must not exceed"):
        Settings(attach_token_ttl=7200, attach_token_max_ttl=3600)
    with pytest.raises(SettingsError, match="at least 32"):
        Settings(attach_secret="short")
    assert Settings.from_env({"BROKER_ATTACH_TOKEN_TTL": "5m"}).attach_token_ttl == 300


def test_an_attach_token_never_outlives_the_jwt_that_minted_it(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    exp = int(time.time()) + 120
    token = user_jwt({"sub": "acme", "exp": exp})
    turn = start_turn(broker.base_url, "c", auth=token, tokens=2)
    minted = mint(broker, turn["turn_id"], auth=token, ttl_s=3600)
    assert minted["expires_at"] <= exp
    claims = jwt.decode(
        minted["token"], ATTACH_SECRET, algorithms=["HS256"], audience="broker-attach"
    )
    assert claims["exp"] <= exp


def test_another_tenants_expired_stream_is_404_not_410(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory, stream_ttl=0.5)
    turn = start_turn(broker.base_url, "c", auth=KEY_A, tokens=2)
    wait_final(broker.base_url, turn["turn_id"], auth=KEY_A)
    path = f"/v1/streams/{turn['stream_id']}"
    wait_until(lambda: call(broker, "GET", path, KEY_A).status_code == 410, timeout=10)
    assert call(broker, "GET", path, KEY_B).status_code == 404


def test_tokens_minted_while_open_are_refused_once_keys_are_on(
    broker_factory: BrokerFactory,
) -> None:
    open_broker = broker_factory(key_prefix=f"upgrade-{time.monotonic_ns()}")
    turn = start_turn(open_broker.base_url, "c", tokens=2)
    token = mint(open_broker, turn["turn_id"], auth=None)["token"]
    path = f"/v1/streams/{turn['stream_id']}"
    assert call(open_broker, "GET", path, params={"token": token}).status_code == 200
    open_broker.stop()
    now_secured = broker_factory(
        key_prefix=open_broker.settings.key_prefix, api_keys=f"acme={KEY_A}"
    )
    refused = call(now_secured, "GET", path, params={"token": token})
    assert refused.status_code == 401
    assert error_code(refused) == "bad_token"


def test_commented_out_keys_stay_revoked_and_errors_never_echo_keys() -> None:
    table = parse_api_keys(f"# revoked: acme={KEY_A}, globex={KEY_B}\nacme={KEY_B}\n", "f")
    assert list(table.values()) == ["acme"]
    with pytest.raises(SettingsError) as info:
        parse_api_keys(f"acme={KEY_A},{KEY_B}", "BROKER_API_KEYS")
    assert KEY_B not in str(info.value)
    assert "entry 2" in str(info.value)
    with pytest.raises(SettingsError, match="must differ"):
        Settings(jwt_secret=JWT_SECRET, attach_secret=JWT_SECRET)
