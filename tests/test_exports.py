"""The public names of each package are chosen, not accidental: changing them is a decision.

Each package's ``__all__`` is compared with what its namespace really holds (``vars``), so a name
that leaks into a package (an import, a helper, a constant defined in ``__init__``) fails here,
and so does a listed name that is missing. Submodules are not names of their own: importing one
puts it in its package's namespace.
"""

from __future__ import annotations

import importlib
import types

import pytest

import broker
import broker_client

PACKAGES = (
    "broker",
    "broker.api",
    "broker.fastpath",
    "broker.providers",
    "broker.dialects.openai",
    "broker.dialects.aisdk",
    "broker.durable_store",
    "broker_client",
)


def namespace(module: types.ModuleType) -> list[str]:
    """The public names a package's namespace holds: no private names, no submodules."""
    return sorted(
        name
        for name, value in vars(module).items()
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(value, types.ModuleType)
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_exactly_the_namespace(name: str) -> None:
    module = importlib.import_module(name)
    assert sorted(module.__all__) == namespace(module)


def test_broker_public_api() -> None:
    assert sorted(broker.__all__) == ["BrokerError", "Settings", "__version__"]


def test_fast_path_public_api() -> None:
    """What the assembly, the Redis client and the size guards take from the fast path's room."""
    import broker.fastpath

    assert sorted(broker.fastpath.__all__) == sorted(
        [
            "CALLER_REFUSAL",
            "CALLER_RETRY_AFTER_S",
            "CLOSE_GRACE_S",
            "NAMES",
            "SHARE",
            "UNSENT_LIMIT",
            "CallerShares",
            "ConnectionLimits",
            "FastPath",
            "PrivateName",
            "Share",
            "StockHttpProtocol",
            "drop_idle",
            "http_protocol_class",
            "make_pool",
            "probe",
            "stock_protocol",
            "trim_idle",
            "uncapped_addresses",
        ]
    )


def test_client_public_api() -> None:
    assert sorted(broker_client.__all__) == sorted(
        [
            "ApprovalDecision",
            "ApprovalRequest",
            "AttachPolicy",
            "AttachStats",
            "AttachToken",
            "BadRequest",
            "BrokerClient",
            "BrokerClientError",
            "BrokerConnectionError",
            "BrokerHTTPError",
            "Conflict",
            "Event",
            "Forbidden",
            "NotFound",
            "Page",
            "RateLimited",
            "Unauthorized",
            "ProtocolError",
            "ReattachExhausted",
            "ReconnectInfo",
            "ResponseEnded",
            "SSEDecoder",
            "ServerError",
            "ServerSentEvent",
            "StreamExpired",
            "StreamNotFound",
            "Turn",
            "TurnNotFound",
            "TurnText",
            "__version__",
            "backoff_delay",
            "decode_all",
        ]
    )


def test_durable_store_public_api() -> None:
    """The Durable Streams service as the HTTP door sees it: the service and its subscriptions,
    what they take and give, their pure checks and their own exceptions; never their keys,
    scripts or reply decoders."""
    import broker.durable_store

    assert sorted(broker.durable_store.__all__) == [
        "AlreadyClaimed",
        "AppendDone",
        "AppendRequest",
        "Appended",
        "AppendsFull",
        "ClosedAgain",
        "CreateRequest",
        "Duplicate",
        "DurableStore",
        "ForkRequest",
        "Meta",
        "QuotaExceeded",
        "Read",
        "StaleEpoch",
        "StreamMade",
        "Subscription",
        "Subscriptions",
        "Wake",
        "WakeLoop",
        "checked_id",
        "checked_url",
        "parse_config",
        "stream_list",
    ]
