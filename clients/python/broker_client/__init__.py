"""Client for the resumable stream broker: start LLM turns and follow their event streams.

`BrokerClient.attach` yields a turn's events over SSE and reconnects by itself from the last event
id when the connection or the broker goes away; `TurnText` folds those events into text.
`BrokerClient(api_key=...)` talks to a broker that needs credentials, and `mint_attach_token`
hands out read-only access to one turn's stream.
"""

from .assemble import TurnText
from .client import AttachPolicy, AttachStats, BrokerClient, ReconnectInfo, backoff_delay
from .errors import (
    BadRequest,
    BrokerClientError,
    BrokerConnectionError,
    BrokerHTTPError,
    Conflict,
    Forbidden,
    NotFound,
    ProtocolError,
    RateLimited,
    ReattachExhausted,
    ResponseEnded,
    ServerError,
    StreamExpired,
    StreamNotFound,
    TurnNotFound,
    Unauthorized,
)
from .models import ApprovalDecision, ApprovalRequest, AttachToken, Event, Page, Turn
from .sse import ServerSentEvent, SSEDecoder, decode_all

__version__ = "0.1.0"

__all__ = [
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
    "ProtocolError",
    "RateLimited",
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
    "Unauthorized",
    "__version__",
    "backoff_delay",
    "decode_all",
]
