"""On a 3-primary cluster the broker's commands spread evenly, and no key outside a conversation's
own is hot (issue 18, "Spread").

The broker runs 300 conversations of one short simulated turn each, every one read to its end.

* Per primary: ``CONFIG RESETSTAT`` on every primary before, ``INFO commandstats`` on each after;
  each must have served 33% +- 10% of the calls (the commands a Lua script runs count on the
  primary that runs it, which is the conversation's, as they should).
* Per key: the server keeps no per-key command counts (``MONITOR`` would, at a cost that changes
  what it measures, and ``OBJECT FREQ`` needs an LFU eviction policy the broker refuses). So the
  test counts in-process: the broker runs in this process, and every command any of its asyncio
  connections sends, alone or in a pipeline, passes through ``pack_command``. Each command is
  charged once to every key it names, a key being an argument under the broker's key prefix
  (channels too: a sharded channel lives in a slot like a key). No key outside the
  conversations' own hash tags ``{c:...}`` may take more than 2% of all commands.

The conversations belong to 10 tenants (API keys), as on a broker that serves several. A tenant's
limits (its rate bucket, its live streams) are one slot per tenant by design: a limit shared by
all of a tenant's turns has to live somewhere, so one tenant's keys carry a fixed cost per
generation, which the last test holds to 2 commands.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio.connection import AbstractConnection

from tests.conftest import CLUSTER_MODE, start_broker
from tests.helpers import read_sse, start_turn
from tests.redis_cluster import LocalCluster

pytestmark = pytest.mark.skipif(
    not CLUSTER_MODE, reason="measures a cluster's primaries: runs with BROKER_TEST_CLUSTER=1"
)

CONVERSATIONS = 300
TENANTS = {f"tenant-{n}": f"spread-key-{n:02d}-0123456789" for n in range(10)}
SHARE, TOLERANCE = 1 / 3, 0.10
HOT_KEY_SHARE = 0.02
# The test's own commands to the primaries, not the broker's.
OWN_COMMANDS = {"cmdstat_config", "cmdstat_info"}


class CommandsPerKey:
    """Counts the commands the process's asyncio Redis connections send, in total and per key."""

    def __init__(self, prefix: str) -> None:
        self.prefix = f"{prefix}:"
        self.total = 0
        self.per_key: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, args: tuple[Any, ...]) -> None:
        keys = set()
        for arg in args[1:]:
            text = arg.decode(errors="replace") if isinstance(arg, bytes) else arg
            if isinstance(text, str) and text.startswith(self.prefix):
                keys.add(text)
        with self._lock:
            self.total += 1
            self.per_key.update(keys)

    def hottest_outside_conversations(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` keys with the most commands among those outside every conversation."""
        others = collections.Counter(
            {key: count for key, count in self.per_key.items() if "{c:" not in key}
        )
        return others.most_common(n)


@contextlib.contextmanager
def counting(counter: CommandsPerKey) -> Iterator[None]:
    """Counts each command once, as it is packed (a pipeline packs each of its commands)."""
    original = AbstractConnection.pack_command

    def pack_command(self: AbstractConnection, *args: Any) -> list[bytes]:
        counter.count(args)
        return original(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AbstractConnection, "pack_command", pack_command)
        yield


def calls_per_primary(cluster: LocalCluster) -> dict[int, int]:
    calls: dict[int, int] = {}
    for port, node in zip(cluster.ports, cluster.nodes(), strict=True):
        with node:
            stats: dict[str, Any] = node.info("commandstats")
        calls[port] = sum(
            int(value["calls"]) for name, value in stats.items() if name not in OWN_COMMANDS
        )
    return calls


@dataclasses.dataclass(frozen=True)
class Spread:
    calls_per_primary: dict[int, int]
    commands: CommandsPerKey


@pytest.fixture(scope="module")
def spread(session_cluster: LocalCluster) -> Spread:
    """The 300 conversations, run once for both tests. The turn rate limit is off so that they
    start at once (its bucket would be one more per-tenant key on every turn)."""
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in TENANTS.items())
    broker = start_broker(session_cluster.url, turn_rate_per_s=0, api_keys=api_keys)
    try:
        counter = CommandsPerKey(broker.settings.key_prefix)
        for node in session_cluster.nodes():
            with node:
                node.config_resetstat()

        keys = list(TENANTS.values())

        def one_conversation(n: int) -> None:
            key = keys[n % len(keys)]
            turn = start_turn(broker.base_url, f"spread-{n}", auth=key, tokens=8, tokens_per_s=0)
            events = read_sse(broker.base_url, turn["stream_id"], auth=key).events
            assert events[-1].event == "end", events[-1]
            assert events[-1].data["status"] == "complete", events[-1]

        with counting(counter), concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one_conversation, range(CONVERSATIONS)))
        calls = calls_per_primary(session_cluster)
    finally:
        broker.stop()
    return Spread(calls, counter)


def test_each_primary_serves_a_third_of_the_commands_of_300_conversations(
    spread: Spread,
) -> None:
    total = sum(spread.calls_per_primary.values())
    shares = {port: n / total for port, n in spread.calls_per_primary.items()}
    assert all(abs(share - SHARE) <= TOLERANCE for share in shares.values()), shares


def test_no_key_outside_the_conversations_takes_more_than_2_percent(spread: Spread) -> None:
    commands = spread.commands
    assert commands.total > CONVERSATIONS, "the broker's commands were not counted"
    hottest = commands.hottest_outside_conversations(5)
    assert hottest, "no key outside the conversations was counted"
    _, most = hottest[0]
    assert most / commands.total <= HOT_KEY_SHARE, (
        ", ".join(f"{key} {n / commands.total:.1%}" for key, n in hottest)
        + f" of {commands.total} commands"
    )


def test_a_tenants_limits_cost_two_commands_per_generation(spread: Spread) -> None:
    """Its live-stream slot is taken (with the rate token, in one script) and given back."""
    per_tenant = CONVERSATIONS // len(TENANTS)
    tenant_keys = {
        key: n for key, n in spread.commands.per_key.items() if "{t:" in key and "{c:" not in key
    }
    tenants = {key.partition("{t:")[2].partition("}")[0] for key in tenant_keys}
    assert tenants == set(TENANTS), tenant_keys
    assert all(n <= 2 * per_tenant for n in tenant_keys.values()), tenant_keys
