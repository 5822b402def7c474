"""A rate of control loop iterations and its flag syntax: the seed's ``"DURATION,BURST"``.

``"250ms,8"`` is a bucket of 8 tokens refilled at one token every 250 ms.
DURATION uses Go's duration syntax (``1h2m3.5s``, units ns, us, ms, s, m,
h), which is what operators of the original wrote in their flags. The
limiter that spends the tokens is :mod:`shepherd.rate_limit`'s; this part
needs no Trio, so the command line parses rates without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shepherd.errors import ShepherdError

__all__ = ["SYNTAX", "Rate", "RateSyntaxError", "parse_duration"]

SYNTAX = "'duration,count' eg. '2m,10' for a 10-sized bucket refilled at one token every 2 minutes"

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 micro sign
    "μs": 1e-6,  # U+03BC Greek mu
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_COMPONENT = re.compile(r"(\d*(?:\.\d*)?)([^\d.]*)")


class RateSyntaxError(ShepherdError, ValueError):
    """A rate or duration string is malformed. The message says what is wrong."""


def parse_duration(text: str) -> float:
    """Parse a Go-style duration (``"250ms"``, ``"1h30m"``, ``"0"``) into seconds.

    Raises :class:`RateSyntaxError` with Go's wording (``time: missing unit in
    duration "1"``) for anything Go's ``time.ParseDuration`` would reject.
    """
    quoted = '"' + text + '"'
    rest = text
    sign = 1.0
    if rest[:1] in ("+", "-"):
        sign = -1.0 if rest[0] == "-" else 1.0
        rest = rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise RateSyntaxError(f"time: invalid duration {quoted}")
    total = 0.0
    while rest:
        match = _COMPONENT.match(rest)
        assert match is not None  # the pattern matches the empty string
        number, unit = match.groups()
        if number in ("", "."):
            raise RateSyntaxError(f"time: invalid duration {quoted}")
        if not unit:
            raise RateSyntaxError(f"time: missing unit in duration {quoted}")
        if unit not in _UNITS:
            raise RateSyntaxError(f'time: unknown unit "{unit}" in duration {quoted}')
        total += float(number) * _UNITS[unit]
        rest = rest[match.end() :]
    return sign * total


@dataclass(frozen=True)
class Rate:
    """One token every ``interval`` seconds, at most ``burst`` tokens stored."""

    interval: float
    burst: int

    @classmethod
    def parse(cls, text: str) -> Rate:
        """Parse ``"DURATION,BURST"``; :class:`RateSyntaxError` says what is wrong."""
        parts = text.split(",")
        if len(parts) != 2:
            raise RateSyntaxError(f"invalid syntax, want: {SYNTAX}")
        try:
            interval = parse_duration(parts[0])
        except RateSyntaxError as exc:
            raise RateSyntaxError(f"invalid duration: {exc}") from None
        if interval < 0:
            raise RateSyntaxError(f"invalid duration: {parts[0]!r} is negative")
        if not parts[1].isdigit() or not parts[1].isascii():
            raise RateSyntaxError(f"invalid refill rate: {parts[1]!r} is not a whole number")
        burst = int(parts[1])
        if not 1 <= burst < 2**31:
            raise RateSyntaxError(f"invalid refill rate: {burst} is not in 1..{2**31 - 1}")
        return cls(interval, burst)
