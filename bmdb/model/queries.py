"""`Queries`: the typed SQL of the BMDB, one async method per statement.

A `Queries` is bound to one open transaction; it is handed to the functions
given to `Session.transact`, `Session.work` (the work source) and
`Work.finish`. Methods validate their arguments before touching the
database and raise `InvalidArgument` for bad input (the surrounding
transaction is then rolled back, leaving the database as it was).

The statements live by domain, each module a mixin of
`bmdb.model.base.QueriesBase` (the transaction, and ``execute``):

    machines      machines, provider tags, SSH host keys
    agents        agent start, heartbeats, hardware reports, carried requests
    installs      OS installation requests, reports and checks
    sourcing      the agent processes' sources (locking inside a work source)
    decommission  a decommission's source and steps, to the tombstone
    upgrades      rolling upgrade runs and each machine's upgrade
    history       work history, audit appends, sessions, work, summaries

`Queries` composes them, so a caller holds one object with every method,
and a reader finds a statement by its domain's module. What makes a
machine free for a source is `bmdb.model.claimable`'s; argument checks
are `bmdb.model.checks`'.
"""

from __future__ import annotations

from bmdb.model.decommission import DecommissionQueries
from bmdb.model.history import HistoryQueries
from bmdb.model.installs import InstallQueries
from bmdb.model.machines import MachineQueries
from bmdb.model.sourcing import SourcingQueries
from bmdb.model.upgrades import UpgradeQueries


class Queries(
    MachineQueries,
    DecommissionQueries,  # an AgentQueries too: a tombstone forgets the agent
    InstallQueries,
    SourcingQueries,
    UpgradeQueries,
    HistoryQueries,
):
    """The BMDB's statements, run in the transaction of ``pg``.

    ``locking`` is set by `Session.work` for its source function: sourcing
    queries then lock what they return (see `bmdb.model.sourcing`).
    """
