"""How often a registered node asks whether the owner approved it.

An approver that acts on its agent's report approves within about a
second of the registration; the node's first asks come a tenth of a
second apart and double up to ``poll``, so that it commits soon after the
approval without asking a curator every tenth of a second while a person
decides.
"""

from __future__ import annotations

import math

import pytest

from common.backoff import Retrier
from metropolis.roleserve.register import APPROVAL_POLL, approval_asks


def _waits(poll: float, count: int) -> list[float]:
    asks = Retrier(approval_asks(poll))
    return [asks.next_delay() for _ in range(count)]


def test_the_first_asks_come_soon_and_double_up_to_poll() -> None:
    assert APPROVAL_POLL == 0.1
    assert _waits(1.0, 7) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert _waits(5.0, 8)[-2:] == pytest.approx([5.0, 5.0])


def test_a_poll_shorter_than_the_first_wait_is_every_wait() -> None:
    assert _waits(0.05, 4) == pytest.approx([0.05] * 4)


@pytest.mark.parametrize("poll", [0.0, -1.0, math.nan, math.inf])
def test_a_poll_that_is_not_a_positive_number_is_refused(poll: float) -> None:
    with pytest.raises(ValueError, match="register poll must be a positive number"):
        approval_asks(poll)
