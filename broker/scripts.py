"""The Lua scripts of ``broker/lua/``: loaded once, called by name, error replies mapped.

Each script is one atomic operation whose contract is written in its file header. redis-py's
``register_script`` sends EVALSHA and reloads the script by itself after ``NOSCRIPT`` (a restarted
or failed-over server), so callers never see that case.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from broker.errors import FencedWrite, StopRequested, StreamFull

NAMES = (
    "create_turn",
    "claim_lease",
    "renew_lease",
    "append_events",
    "finish_attempt",
    "promote_attempt",
    "start_attempt",
    "cancel_turn",
    "take_retry_budget",
    "claim_tool",
    "renew_tool",
    "finish_tool",
    "admit_turn",
    "renew_viewer",
    "release_viewer",
    "release_lease",
)


def script_source(name: str) -> str:
    """The text of ``broker/lua/<name>.lua``."""
    return resources.files("broker").joinpath("lua", f"{name}.lua").read_text("utf-8")


class Scripts:
    """Registered scripts for one Redis client."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(script_source(name)) for name in NAMES
        }

    async def load(self) -> None:
        """Load every script now, so a broken script fails the start, not the first turn."""
        for script in self._scripts.values():
            script.sha = await self.redis.script_load(script.script)

    async def loaded(self) -> bool:
        """Whether the server still has every script cached (readiness)."""
        shas = [script.sha for script in self._scripts.values()]
        found = await self.redis.script_exists(*shas)
        return all(found)

    async def __call__(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            message = str(exc)
            if "FENCED" in message:
                raise FencedWrite(message.split("FENCED", 1)[1].strip()) from None
            if "CANCELLED" in message:
                raise StopRequested(message.split("CANCELLED", 1)[1].strip()) from None
            if "STREAM_FULL" in message:
                raise StreamFull(message.split("STREAM_FULL", 1)[1].strip()) from None
            raise
