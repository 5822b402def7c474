"""What the machines list says to a newcomer when there is nothing to do there.

Two fleets leave a first page with nothing to click: an empty one (the
next step is a command that adds machines, which the read-only UI cannot
do) and one where every machine failed (the next step is the cause they
share, and the list of the failed ones). Any other fleet gets no text.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from bmdb.overview import MachineState, State, StateCounts
from console.render import Html, esc, link, url

__all__ = ["ADD_MACHINES", "next_step"]

#: The command that brings a provider's machines into the BMDB (README).
ADD_MACHINES = (
    "python -m shepherd --bmdb-url URL --provider static --static-machines-path machines.toml"
)


def next_step(counts: StateCounts | None, rows: Sequence[MachineState]) -> Html:
    """A paragraph for the unfiltered first page: on an empty fleet the
    command that adds machines; when every machine counted failed, the
    cause most of ``rows`` (the page's machines) share and a link to the
    failed ones; empty markup otherwise, and without ``counts``."""
    if counts is None:
        return Html("")
    if counts.total == 0:
        return Html(
            '<p id="next-step">No machines yet. The Shepherd adds every machine its provider'
            f" lists: <code>{esc(ADD_MACHINES)}</code> (the README's machines file format;"
            " <code>bin/demo --web</code> shows a whole fleet on this machine).</p>"
        )
    failed = counts.by_state.get(State.FAILED, 0)
    if failed != counts.total:
        return Html("")
    causes = collections.Counter(m.cause for m in rows if m.cause)
    said = ""
    if causes:
        cause, n = causes.most_common(1)[0]
        said = f" {n} of the {len(rows)} shown failed with: <q>{esc(cause)}</q>."
    return Html(
        f'<p id="next-step" class="state-failed">Every machine failed ({failed}).{said}'
        " Fix that cause (the machine's page has its history), then"
        " <code>python -m bmdb retry-now MACHINE --reason ...</code> ends its backoff; "
        + link(url("/machines", {"state": State.FAILED}), "the failed machines")
        + "</p>"
    )
