"""The HTTP API: routes, error mapping, size guards and security headers."""

from broker.api.errors import install_error_handlers
from broker.api.limits import BodySizeLimit, HeaderSizeLimit
from broker.api.routes import api_router, ops_router
from broker.api.security import SecurityHeaders, cors_origins

__all__ = [
    "BodySizeLimit",
    "HeaderSizeLimit",
    "SecurityHeaders",
    "api_router",
    "cors_origins",
    "install_error_handlers",
    "ops_router",
]
