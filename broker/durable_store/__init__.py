"""Durable Streams' own streams: a small service beside the core, with typed results.

The HTTP door (:mod:`broker.dialects.durable`) reaches it through the runtime's
:class:`DurableStore` and the pure rules of :mod:`broker.durable_store.protocol`; the keys,
scripts and replies stay inside this package.
"""

from broker.durable_store.errors import AppendsFull, QuotaExceeded, StaleEpoch
from broker.durable_store.records import AppendRequest, CreateRequest, ForkRequest, Meta, Read
from broker.durable_store.replies import AppendDone, Appended, ClosedAgain, Duplicate, StreamMade
from broker.durable_store.service import DurableStore
from broker.durable_store.sub_model import checked_id, checked_url, parse_config, stream_list
from broker.durable_store.subscriptions import AlreadyClaimed, Subscription, Subscriptions, Wake
from broker.durable_store.wakes import WakeLoop

__all__ = [
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
