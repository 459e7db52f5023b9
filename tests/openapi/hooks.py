"""Hooks for the schemathesis run of ``tests/test_openapi_conformance.py`` (``SCHEMATHESIS_HOOKS``).

The document says in words what JSON Schema cannot say across parameters; these hooks make the
generated requests keep those rules, so that every other check still applies to them.
"""

from __future__ import annotations

from typing import Any

import schemathesis

STREAM = "/v1/streams/{stream_id}"
# Query parameters that apply to one format of a stream read only: a 400 with the other.
FORMAT_OF: dict[str, str] = {"wait": "json", "heartbeat": "sse", "batch_ms": "sse"}
# Short answers at full speed: the run checks the HTTP surface, not the simulator's pace (a
# non-streaming completion waits for its answer: 48 deltas at 25/s by default).
FAST = {"simulate": {"tokens": 3, "tokens_per_s": 0}}
# Where each operation that starts a generation takes the provider's params.
PARAMS_AT: dict[str, tuple[str, ...]] = {
    "/v1/turns": ("params",),
    "/v1/ui/chat": ("params",),
    "/v1/responses": ("broker", "params"),
    "/v1/chat/completions": ("broker", "params"),
}
# Query parameters that need another one: starting_after reads a response's events.
NEEDS: dict[tuple[str, str], tuple[str, str]] = {
    ("/v1/responses/{response_id}", "starting_after"): ("stream", "true"),
}


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """A stream read that sets ``wait`` asks for a JSON page, one that sets ``heartbeat`` or
    ``batch_ms`` for SSE. A request generated to be invalid keeps its invalid part: only a
    missing ``format`` is filled in for it."""
    meta = getattr(case, "meta", None)
    negative = meta is not None and meta.generation.mode.is_negative
    path = case.operation.path
    if path in PARAMS_AT and isinstance(case.body, dict):
        _fast(case.body, PARAMS_AT[path])
    query = case.query
    if not query:
        return
    for (needer, name), (other, value) in NEEDS.items():
        if path == needer and name in query and (other not in query or not negative):
            query[other] = value
    if path != STREAM:
        return
    asked = [name for name in FORMAT_OF if name in query]
    if not asked:
        return
    if negative:
        if "format" not in query:
            query["format"] = FORMAT_OF[asked[0]]
        return
    wanted = FORMAT_OF[asked[0]]
    for name in asked[1:]:  # no read takes both formats' parameters: keep the first's
        if FORMAT_OF[name] != wanted:
            del query[name]
    query["format"] = wanted


def _fast(body: dict[str, Any], at: tuple[str, ...]) -> None:
    """Give a body the :data:`FAST` knobs where it names none. What it names is left as it is:
    it may be the part that a case was generated to get wrong."""
    node = body
    for key in at:
        if node.get(key) is None:  # absent, or null: the same to the broker
            node[key] = {}
        if not isinstance(node[key], dict):
            return
        node = node[key]
    if not node:
        node.update(FAST)
