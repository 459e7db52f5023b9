"""The silent-retry policy: before the first delta only, capped per turn and per session.

A retry is allowed while the attempt has made fewer than ``BROKER_MAX_ATTEMPTS_PER_TURN``
upstream calls and the session's sliding-window budget (``BROKER_SESSION_RETRY_BUDGET`` per
``BROKER_SESSION_RETRY_WINDOW``, kept in Redis on the server clock) has room. The pause before a
retry is drawn uniformly from the backoff window (full jitter), so retries of many turns that
failed together do not arrive together.
"""

from __future__ import annotations

import random
import secrets

from broker.deps import Deps
from broker.metrics import error_code

ATTEMPTS_EXHAUSTED = "attempts_exhausted"
BUDGET_EXHAUSTED = "retry_budget_exhausted"


class RetryPolicy:
    """Decides whether a failed upstream call may be retried silently, and when."""

    def __init__(self, deps: Deps) -> None:
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._random = random.Random()

    def backoff_s(self, retry_after_s: float | None = None) -> float:
        """The pause before a retry: drawn from the window, or the upstream's Retry-After
        held within the window (a longer wait would stall a reader who sees nothing yet)."""
        low, high = self._settings.retry_backoff_min_ms, self._settings.retry_backoff_max_ms
        if retry_after_s is not None:
            return min(max(retry_after_s * 1000, low), high) / 1000
        return self._random.uniform(low, high) / 1000

    async def permit(
        self, session: str, calls_made: int, reason: str, code: str | None
    ) -> str | None:
        """None when one more call may be made; otherwise which limit stopped it.

        ``reason`` and ``code`` say why the last call failed (``code``: the upstream error's,
        None for a lost worker); they label the retry or the exhausted attempt.
        """
        label = error_code(code)
        if calls_made >= self._settings.max_attempts_per_turn:
            self._metrics.retry_budget_exhausted.labels("turn").inc()
            self._metrics.attempts_exhausted.labels(label).inc()
            return ATTEMPTS_EXHAUSTED
        allowed = await self._scripts.take_retry_budget(
            budget_key=self._keys.retry_budget(session),
            budget=self._settings.session_retry_budget,
            window_ms=self._settings.session_retry_window_ms,
            member=secrets.token_hex(8),
        )
        if not allowed:
            self._metrics.retry_budget_exhausted.labels("session").inc()
            return BUDGET_EXHAUSTED
        self._metrics.retries.labels(reason, label).inc()
        return None
