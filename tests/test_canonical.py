"""Canonical JSON, byte for byte: the fingerprints of requests and tool arguments rest on it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.canonical import canonical_json, fingerprint


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"b": 1, "a": 2}, b'{"a":2,"b":1}'),
        ({"a": {"d": [3, {"z": 1, "y": 2}], "c": None}}, b'{"a":{"c":null,"d":[3,{"y":2,"z":1}]}}'),
        ({"\u00e9": 1, "z": 2, "A": 3}, '{"A":3,"z":2,"\u00e9":1}'.encode()),
        ({"emoji": "🚀", "cjk": "日本"}, '{"cjk":"日本","emoji":"🚀"}'.encode()),
        ({"q": 'say "hi"\\\n'}, b'{"q":"say \\"hi\\"\\\\\\n"}'),
        ([10.0, -0.0, 0.1, 1e100, 2**60, 1.5], b"[10,0,0.1,1e+100,1152921504606846976,1.5]"),
        ([True, False, None], b"[true,false,null]"),
        ({"amount": 12.50, "currency": "EUR"}, b'{"amount":12.5,"currency":"EUR"}'),
    ],
)
def test_exact_bytes(value: Any, expected: bytes) -> None:
    assert canonical_json(value) == expected


def test_whitespace_and_key_order_do_not_change_the_fingerprint() -> None:
    a = json.loads('{ "to": "bob",\n  "amount": 10 }')
    b = json.loads('{"amount":10.0,"to":"bob"}')
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint({"amount": 10, "to": "Bob"})


def test_unicode_is_not_normalized() -> None:
    assert fingerprint({"name": "caf\u00e9"}) != fingerprint({"name": "cafe\u0301"})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="NaN"):
        canonical_json({"x": bad})


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_canonical_form_is_stable_under_a_round_trip(value: Any) -> None:
    once = canonical_json(value)
    assert canonical_json(json.loads(once)) == once
