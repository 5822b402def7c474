"""What the machines list says to a newcomer when there is nothing to do there.

Two fleets leave a first page with nothing to click: an empty one (the
next step is a command that adds machines, which the read-only UI cannot
do) and one where every machine failed (the next step is the cause they
share, and the list of the failed ones). Any other fleet gets no text.
This module decides which; ``templates/machines.html`` says it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from bmdb.overview import MachineState, State, StateCounts

__all__ = ["ADD_MACHINES", "NextStep", "next_step"]

#: The command that brings a provider's machines into the BMDB (README).
ADD_MACHINES = (
    "python -m shepherd --bmdb-url URL --provider static --static-machines-path machines.toml"
)


@dataclass(frozen=True)
class NextStep:
    """The next step on the first page: on an empty fleet (``failed`` 0)
    the command `ADD_MACHINES`; else every one of ``failed`` machines
    failed, ``sharing`` of the ``shown`` ones with ``cause`` (None if none
    of them has a cause)."""

    failed: int = 0
    cause: str | None = None
    sharing: int = 0
    shown: int = 0


def next_step(counts: StateCounts | None, rows: Sequence[MachineState]) -> NextStep | None:
    """The next step for the unfiltered first page: on an empty fleet the
    command that adds machines; when every machine counted failed, the
    cause most of ``rows`` (the page's machines) share; None otherwise,
    and without ``counts``."""
    if counts is None:
        return None
    if counts.total == 0:
        return NextStep()
    failed = counts.by_state.get(State.FAILED, 0)
    if failed != counts.total:
        return None
    causes = collections.Counter(m.cause for m in rows if m.cause)
    if not causes:
        return NextStep(failed=failed, shown=len(rows))
    cause, n = causes.most_common(1)[0]
    return NextStep(failed=failed, cause=cause, sharing=n, shown=len(rows))
