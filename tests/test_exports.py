"""The public names of each package are chosen, not accidental: changing them is a decision."""

from __future__ import annotations

import broker
import broker_client


def test_broker_public_api() -> None:
    assert sorted(broker.__all__) == ["BrokerError", "Settings", "__version__"]
    for name in broker.__all__:
        assert hasattr(broker, name)


def test_client_public_api() -> None:
    assert sorted(broker_client.__all__) == sorted(
        [
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
    for name in broker_client.__all__:
        assert hasattr(broker_client, name)
