"""`Backoff`: how long a failed machine stays hidden from a process.

Each `Work.fail` with a backoff stores the interval it used; the next
failure of the same (machine, process) grows it exponentially::

    next = initial                                  no previous interval, or exponent <= 1
    next = min(maximum, ceil(previous * exponent))  otherwise
    next = max(next, 1)                             whole seconds, never below one

For initial 60 s, exponent 1.1, maximum 120 s the intervals are 60, 66, 73,
81, 90, 99, 109, 120, 120. `Work.finish` clears the stored interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from bmdb.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff parameters, in seconds.

    ``maximum`` defaults to ``initial`` (a constant backoff) and ``exponent``
    to 1. Invalid parameters raise `InvalidArgument` at construction.
    """

    initial: float
    maximum: float | None = None
    exponent: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.initial) or self.initial < 0:
            raise InvalidArgument(f"backoff initial must be >= 0 seconds, got {self.initial!r}")
        if self.maximum is not None and (
            not math.isfinite(self.maximum) or self.maximum < self.initial
        ):
            raise InvalidArgument(
                f"backoff maximum must be >= initial ({self.initial}), got {self.maximum!r}"
            )
        if not math.isfinite(self.exponent) or self.exponent <= 0:
            raise InvalidArgument(f"backoff exponent must be > 0, got {self.exponent!r}")

    def next(self, previous: int | None = None) -> int:
        """The interval in whole seconds to use after ``previous`` (None if
        there was no earlier failure)."""
        if previous is None or self.exponent <= 1:
            seconds = math.ceil(self.initial)
        else:
            # Decimal(str(...)) so that 90 * 1.1 is 99, not 99.00000000000001
            # rounded up to 100 as binary floating point would have it.
            grown = math.ceil(Decimal(previous) * Decimal(str(self.exponent)))
            ceiling = self.initial if self.maximum is None else self.maximum
            seconds = min(grown, math.ceil(ceiling))
        return max(seconds, 1)
