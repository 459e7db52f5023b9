"""Whole numbers read from the wire (query parameters, headers, an upstream's error bodies).

``int()`` is no parser for them: it takes ``+5``, `` 5 ``, ``5_0`` and other scripts' digits
(``"²".isdigit()`` holds, yet ``int("²")`` raises), and it raises ``ValueError`` for a string of
more than 4,300 digits before any range check could refuse it. :func:`whole_number` accepts
ASCII digits only (and one leading minus where the range goes below zero), measures the digits
against the range before converting them, and answers None for anything else, so each caller
refuses bad input in its own door's error shape.
"""

from __future__ import annotations

import re
from typing import Final

_NUMBER: Final = re.compile(r"-?[0-9]+")


def whole_number(raw: str, low: int, high: int) -> int | None:
    """The value of ``raw`` when it is a whole number from ``low`` to ``high``; None when not.

    Leading zeros are allowed (``007`` is 7), whatever their number: only the significant
    digits are converted, and only when there are no more of them than ``high`` or ``low`` has.
    """
    if _NUMBER.fullmatch(raw) is None:
        return None
    negative = raw.startswith("-")
    if negative and low >= 0:
        return None
    significant = raw.lstrip("-").lstrip("0") or "0"
    if len(significant) > max(len(str(abs(low))), len(str(abs(high)))):
        return None
    value = -int(significant) if negative else int(significant)
    return value if low <= value <= high else None
