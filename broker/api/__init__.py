"""The HTTP API: routes, error mapping and the body-size guard."""

from broker.api.errors import install_error_handlers
from broker.api.limits import BodySizeLimit
from broker.api.routes import api_router, ops_router

__all__ = ["BodySizeLimit", "api_router", "install_error_handlers", "ops_router"]
