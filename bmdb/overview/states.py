"""What state a machine is in, in SQL, so that the CLI listings, the web UI
and the metrics all say the same thing::

    decommissioned     a tombstone: wiped, released to its provider, kept with
                       its history (`bmdb.actions` decommission); nothing
                       works on it, and its installation and node are what
                       it *was* (``was_install_state``), never counted as
                       installed
    failed             an active backoff of any process (cause and end shown)
    unprovided         no provider tag
    needs-agent-start  provided, no agent started
    started            agent started, no heartbeat yet, within 30 minutes
    heartbeating       last heartbeat within 10 minutes
    silent             agent started, but no heartbeat for 30 minutes after the
                       start or none for 10 minutes (what recovery looks for)

"decommissioned" wins over all (a tombstone's agent tags are gone, so it
would otherwise read as needing an agent start); "failed" wins over the
others: a machine in backoff is hidden from a process, which is what an
operator needs to see first. The 10 and 30 minutes are the
recovery sourcing's thresholds (`bmdb.model.sourcing`).

Beside that state, a machine asked to install an OS has an *installation
state* (`InstallState`, none without a request), from its request of
generation g and the report stored on it::

    installing       no report on g yet (none, or one on an older generation)
    installed        the agent reported success on g (the node's id shown)
    install-failed   the agent reported an error on g (its cause shown)
    install-lost     installed, then the agent found g gone from its disk
                     (emptied or written over since; the cause shown)

The two are separate columns because they answer separate questions (is the
agent alive; is the OS on the machine); a ``state`` filter takes the names
of both (`parse_state_filter`). The listing (`bmdb.overview.listing`) and
the counts (`bmdb.overview.counts`) compute both from the fragments here.
"""

from __future__ import annotations

from bmdb.model.installs import INSTALL_STATE_SQL

# The state names live with the rows (the CLI parses them without the
# driver); they are the overview's words, so it offers them too.
from bmdb.model.rows import STATE_FILTERS as STATE_FILTERS
from bmdb.model.rows import State as State
from bmdb.model.rows import parse_state_filter as parse_state_filter

#: The state of machine ``m`` given its joined tags p, a, h, dcm and backoff b.
STATE_SQL = """
    CASE WHEN dcm.decommissioned_at IS NOT NULL THEN 'decommissioned'
         WHEN b.until IS NOT NULL THEN 'failed'
         WHEN p.machine_id IS NULL THEN 'unprovided'
         WHEN a.machine_id IS NULL THEN 'needs-agent-start'
         WHEN h.agent_heartbeat_at >= now() - interval '10 minutes' THEN 'heartbeating'
         WHEN h.machine_id IS NULL AND a.agent_started_at >= now() - interval '30 minutes'
              THEN 'started'
         ELSE 'silent' END
"""

# The tags of machine m.
TAGS = """
    LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
    LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
    LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
    LEFT JOIN machine_decommission dcm ON dcm.machine_id = m.machine_id
"""

# The installation state of machine m: none for a tombstone, whose
# installation is gone with its wipe (`WAS_INSTALL_STATE_SQL` keeps it).
LIVE_INSTALL_STATE_SQL = f"CASE WHEN dcm.decommissioned_at IS NULL THEN {INSTALL_STATE_SQL} END"
WAS_INSTALL_STATE_SQL = f"CASE WHEN dcm.decommissioned_at IS NOT NULL THEN {INSTALL_STATE_SQL} END"


# The latest-ending active backoff of machine m, two ways. A page visits few
# machines in index order: probe work_backoff's index per machine. The counts
# visit every machine: hash the (few) active backoffs once instead, where
# 50,000 probes cost ten times as much.
BACKOFF_PROBED = """
    LEFT JOIN LATERAL (
        SELECT b.process, b.until, b.cause FROM work_backoff b
        WHERE b.machine_id = m.machine_id AND b.until > now()
        ORDER BY b.until DESC LIMIT 1) b ON true
"""
BACKOFF_HASHED = """
    LEFT JOIN (
        SELECT DISTINCT ON (machine_id) machine_id, process, until, cause FROM work_backoff
        WHERE until > now() ORDER BY machine_id, until DESC) b ON b.machine_id = m.machine_id
"""


def state_prefilter(state: State | None) -> str:
    """A condition on machine m alone that holds exactly for the machines
    in ``state``, or ``true`` (None, or a state without one: `STATE_SQL`
    decides). A page selects its machines by it first, where an index
    serves it, before any machine's other joins are read.

    Why: the ``state`` filter compares the computed state, so a page of
    failed machines read machines in order, each with all its joins, until
    it had 101 failed ones (about 257 ms at 100,000 machines). "failed" is
    an active backoff: a semi-join on work_backoff finds those without
    reading the rest, from either side as PostgreSQL's statistics favour:
    the active backoffs by their end (index ``work_backoff_until``,
    migration 0009) when they are few, the machines in order with a probe
    of work_backoff's primary key each when they are many. The other
    states are most of the fleet or cheap to find in order, so they need
    none. Keep this beside `STATE_SQL`: a state added there that is rare
    wants its condition here."""
    if state == State.FAILED:
        # A tombstone's state is decommissioned whatever its backoff.
        return (
            "EXISTS (SELECT 1 FROM work_backoff fb"
            " WHERE fb.machine_id = m.machine_id AND fb.until > now())"
            " AND NOT EXISTS (SELECT 1 FROM machine_decommission fd"
            " WHERE fd.machine_id = m.machine_id AND fd.decommissioned_at IS NOT NULL)"
        )
    return "true"
