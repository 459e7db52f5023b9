"""Canonical JSON: one byte string per JSON value, so equal requests hash equally.

Object keys are sorted by code point, there is no insignificant whitespace, strings are UTF-8
(not ``\\u`` escapes), and numbers are written the way ``orjson`` writes them. Fingerprints are the
hex SHA-256 of that text.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson


def canonical_json(value: Any) -> bytes:
    """Serialize ``value`` canonically."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def fingerprint(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
