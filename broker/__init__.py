"""A Redis-backed resumable stream broker for LLM generations."""

from broker.errors import BrokerError
from broker.settings import Settings

__all__ = ["BrokerError", "Settings", "__version__"]

__version__ = "0.1.0"
