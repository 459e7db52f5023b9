"""Client for the resumable stream broker: start LLM turns and follow their event streams.

`BrokerClient.attach` yields a turn's events over SSE and reconnects by itself from the last event
id when the connection or the broker goes away; `TurnText` folds those events into text.
"""

from .assemble import TurnText
from .client import AttachPolicy, AttachStats, BrokerClient, ReconnectInfo, backoff_delay
from .errors import (
    BadRequest,
    BrokerClientError,
    BrokerConnectionError,
    BrokerHTTPError,
    Conflict,
    NotFound,
    ProtocolError,
    ReattachExhausted,
    ResponseEnded,
    ServerError,
    StreamExpired,
    StreamNotFound,
    TurnNotFound,
)
from .models import Event, Page, Turn
from .sse import ServerSentEvent, SSEDecoder, decode_all

__version__ = "0.1.0"

__all__ = [
    "AttachPolicy",
    "AttachStats",
    "BadRequest",
    "BrokerClient",
    "BrokerClientError",
    "BrokerConnectionError",
    "BrokerHTTPError",
    "Conflict",
    "Event",
    "NotFound",
    "Page",
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
