"""Canonical JSON: one byte string per JSON value, so equal requests and arguments hash equally.

The rules, exactly:

* Objects: keys sorted by Unicode code point; no duplicate keys (the last one wins on parsing).
* No insignificant whitespace: ``,`` and ``:`` with nothing around them.
* Strings: UTF-8, not ``\\u`` escapes; only ``"``, ``\\`` and control characters are escaped.
  Strings are not normalized: ``"é"`` (one code point) and ``"é"`` (two) differ.
* Numbers: an integer is written in decimal without a sign for zero or leading zeros; a float
  with an integral value of magnitude below 2**53 is written as that integer (``10.0`` → ``10``,
  ``-0.0`` → ``0``), so a model that writes ``10.0`` where it wrote ``10`` before is not a
  different call; any other float is written in its shortest round-trip form (``0.1``,
  ``1e+100``). NaN and infinities are not JSON and are refused.
* ``true``, ``false``, ``null`` as they are.

Fingerprints are the hex SHA-256 of that text.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import orjson

_EXACT = 2**53


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("NaN and infinities have no canonical JSON form")
        if value.is_integer() and abs(value) < _EXACT:
            return int(value)
        return value
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def canonical_json(value: Any) -> bytes:
    """Serialize ``value`` canonically (see the module docstring)."""
    return orjson.dumps(_normalize(value), option=orjson.OPT_SORT_KEYS)


def fingerprint(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
