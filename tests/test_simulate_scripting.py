"""Which providers a broker serves, who may script the simulator, and the tenant a tool endpoint
is told (issue 34, finding 5: any tenant could make the broker call the operator's
``send_payment`` with arguments of its choosing, through every door that carries ``params``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.errors import BadRequest
from broker.providers.simulated import KNOBS, SCRIPTING_KNOBS, SimulatedProvider
from broker.settings import Settings, SettingsError
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import ToolEndpoint, bearer, wait_until

KEY = "acme-key-0123456789abcdef"
PAY = {"name": "send_payment", "args": {"to": "mallory", "amount": 1_000_000}, "after": 1}
STARTED = "broker_turns_started_total"
_ids = itertools.count()


def _native(base_url: str, turn_id: str, provider: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "url": f"{base_url}/v1/turns",
        "json": {
            "conversation_id": f"c-{turn_id}",
            "turn_id": turn_id,
            "provider": provider,
            "messages": [{"role": "user", "content": "pay"}],
            "params": params,
        },
    }


def _responses(
    base_url: str, turn_id: str, provider: str, params: dict[str, Any]
) -> dict[str, Any]:
    return {
        "url": f"{base_url}/v1/responses",
        "json": {
            "model": provider,
            "input": "pay",
            "metadata": {"turn_id": turn_id},
            "broker": {"params": params},
        },
    }


def _chat(base_url: str, turn_id: str, provider: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "url": f"{base_url}/v1/chat/completions",
        "json": {
            "model": provider,
            "messages": [{"role": "user", "content": "pay"}],
            "metadata": {"turn_id": turn_id},
            "broker": {"params": params},
        },
    }


def _ui_chat(base_url: str, turn_id: str, provider: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "url": f"{base_url}/v1/ui/chat",
        "json": {
            "id": f"c-{turn_id}",
            "messages": [
                {"id": turn_id, "role": "user", "parts": [{"type": "text", "text": "pay"}]}
            ],
            "trigger": "submit-message",
            "provider": provider,
            "params": params,
        },
    }


Door = Callable[[str, str, str, dict[str, Any]], dict[str, Any]]
# Every door whose requests carry the native `params`.
DOORS: dict[str, Door] = {
    "native": _native,
    "responses": _responses,
    "chat_completions": _chat,
    "ai_sdk": _ui_chat,
}


def send(
    door: str,
    broker: RunningBroker,
    knobs: dict[str, Any],
    *,
    auth: str | None = None,
    provider: str = "simulated",
) -> httpx.Response:
    turn_id = f"turn-{next(_ids)}"
    request = DOORS[door](broker.base_url, turn_id, provider, {"simulate": knobs})
    return httpx.post(request["url"], json=request["json"], headers=bearer(auth), timeout=20)


@pytest.fixture
def tools_file(tmp_path: Path, payments: ToolEndpoint) -> str:
    path = tmp_path / "tools.json"
    tool = {"name": "send_payment", "class": "unkeyed_write", "endpoint": payments.url}
    path.write_text(json.dumps({"tools": [tool]}))
    return str(path)


@pytest.mark.parametrize("door", DOORS)
def test_a_broker_with_credentials_refuses_a_scripted_tool_call_on_every_door(
    broker_factory: BrokerFactory, payments: ToolEndpoint, tools_file: str, door: str
) -> None:
    broker = broker_factory(api_keys=f"acme={KEY}", tools=tools_file)
    refused = send(door, broker, {"tokens": 4, "tokens_per_s": 0, "tool_calls": [PAY]}, auth=KEY)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "simulate_scripting_off"
    assert "params.simulate.tool_calls" in error["message"]
    assert "BROKER_SIMULATE_SCRIPTING" in error["message"]
    # Nothing was started, nothing paid.
    assert broker.metric(STARTED) == 0
    # The knobs that only shape the text are still the caller's.
    harmless = {"seed": 3, "tokens": 4, "tokens_per_s": 0, "json": False}
    taken = send(door, broker, harmless, auth=KEY)
    assert taken.status_code in (200, 201), taken.text
    assert broker.metric(STARTED) == 1
    assert payments.requests == []


@pytest.mark.parametrize("door", DOORS)
def test_scripting_turned_on_dispatches_and_the_endpoint_is_told_the_tenant(
    broker_factory: BrokerFactory, payments: ToolEndpoint, tools_file: str, door: str
) -> None:
    broker = broker_factory(api_keys=f"acme={KEY}", tools=tools_file, simulate_scripting="on")
    taken = send(door, broker, {"tokens": 4, "tokens_per_s": 0, "tool_calls": [PAY]}, auth=KEY)
    assert taken.status_code in (200, 201), taken.text
    wait_until(lambda: len(payments.requests) == 1)
    assert payments.requests[0]["tenant"] == "acme"
    assert payments.requests[0]["body"]["arguments"] == PAY["args"]


def test_an_open_broker_scripts_by_default_and_names_no_tenant(
    broker_factory: BrokerFactory, payments: ToolEndpoint, tools_file: str
) -> None:
    broker = broker_factory(tools=tools_file)
    taken = send("native", broker, {"tokens": 4, "tokens_per_s": 0, "tool_calls": [PAY]})
    assert taken.status_code == 201, taken.text
    wait_until(lambda: len(payments.requests) == 1)
    assert payments.requests[0]["key"]  # the call did reach the endpoint, headers and all
    assert payments.requests[0]["tenant"] is None  # an open broker's turns have no tenant


@pytest.mark.parametrize("door", DOORS)
def test_a_provider_the_broker_does_not_serve_is_a_400_on_every_door(
    broker_factory: BrokerFactory, door: str
) -> None:
    broker = broker_factory(
        providers="openai",
        openai_models="model-a",
        openai_base_url="http://127.0.0.1:9/v1",
        openai_api_key="unused",
    )
    refused = send(door, broker, {"tokens": 4}, provider="simulated")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "provider_not_served"
    assert "'simulated' is not served" in error["message"]
    assert "BROKER_PROVIDERS" in error["message"]
    assert broker.metric(STARTED) == 0


def test_broker_providers_shows_what_is_served_and_the_scripting() -> None:
    env = {
        **os.environ,
        "BROKER_API_KEYS": f"acme={KEY}",
        "BROKER_PROVIDERS": "simulated,openai",
        "BROKER_OPENAI_MODELS": "model-a",
        "BROKER_OPENAI_API_KEY": "unused",
    }
    shown = subprocess.run(
        [sys.executable, "-m", "broker", "providers"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert (
        "simulated  built in: deterministic text, fault and tool scripting off (default)" in shown
    )
    assert "openai" in shown
    assert "served: simulated, openai (BROKER_PROVIDERS=simulated,openai)" in shown
    assert "not served: anthropic" in shown


# --- pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("fail_before_first", 1),
        ("fail_after_deltas", 2),
        ("stall_after_deltas", 2),
        ("first_delta_after_ms", 100),
        ("error", "fatal"),
        ("tool_calls", [PAY]),
        ("fail_after_tool_calls", 1),
        ("cut_during_tool_args", True),
    ],
)
def test_each_scripting_knob_is_refused_when_scripting_is_off(knob: str, value: Any) -> None:
    params = {"simulate": {"tokens": 4, knob: value}}
    SimulatedProvider(scripting=True).validate_params(params)
    with pytest.raises(BadRequest) as caught:
        SimulatedProvider(scripting=False).validate_params(params)
    assert caught.value.code == "simulate_scripting_off"
    assert f"params.simulate.{knob}" in caught.value.message


def test_every_knob_but_the_text_shaping_ones_is_scripting() -> None:
    # A knob added later is harmless only by being put on this list on purpose.
    assert set(KNOBS) - SCRIPTING_KNOBS == {"seed", "tokens", "tokens_per_s", "json", "stamp"}
    harmless = {"seed": "s", "tokens": 4, "tokens_per_s": 0, "json": True}
    SimulatedProvider(scripting=False).validate_params({"simulate": harmless, "temperature": 1})


@pytest.mark.parametrize(
    ("values", "scripting"),
    [
        ({}, True),
        ({"simulate_scripting": "off"}, False),
        ({"api_keys": f"acme={KEY}"}, False),
        ({"jwt_secret": "j" * 32}, False),
        ({"api_keys": f"acme={KEY}", "simulate_scripting": "on"}, True),
        ({"api_keys": f"acme={KEY}", "simulate_scripting": "auto"}, False),
    ],
)
def test_scripting_is_off_with_credentials_unless_turned_on(
    values: dict[str, Any], scripting: bool
) -> None:
    assert Settings(**values).simulate_scripting_on is scripting


REAL = {"openai_models": "m", "anthropic_models": "c", "anthropic_api_key": "k"}


@pytest.mark.parametrize(
    ("values", "served"),
    [
        ({}, ("simulated",)),
        ({"openai_models": "m"}, ("simulated", "openai")),
        (REAL, ("simulated", "openai", "anthropic")),
        # Credentials and a real provider: the simulator is left out unless listed.
        ({**REAL, "api_keys": f"acme={KEY}"}, ("openai", "anthropic")),
        ({"api_keys": f"acme={KEY}"}, ("simulated",)),
        ({**REAL, "api_keys": f"acme={KEY}", "providers": "simulated"}, ("simulated",)),
        ({**REAL, "providers": "anthropic, OpenAI,anthropic"}, ("anthropic", "openai")),
    ],
)
def test_the_served_providers_follow_the_setting_and_the_credentials(
    values: dict[str, Any], served: tuple[str, ...]
) -> None:
    assert Settings(**values).served_providers == served


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BROKER_PROVIDERS": "simulated,bard"}, "BROKER_PROVIDERS names 'bard'"),
        ({"BROKER_PROVIDERS": ","}, "BROKER_PROVIDERS must name at least one"),
        ({"BROKER_PROVIDERS": "openai"}, "BROKER_OPENAI_MODELS is unset"),
        ({"BROKER_SIMULATE_SCRIPTING": "yes"}, "BROKER_SIMULATE_SCRIPTING must be one of"),
    ],
)
def test_bad_provider_settings_stop_the_broker_with_one_line(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
