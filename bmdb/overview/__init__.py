"""What an operator asks of the fleet: each machine's state and why, read-only.

One idea, in a module per question: the states machines are in, written
once in SQL (`bmdb.overview.states`), so that the CLI listings, the web UI
and the metrics all say the same thing; a page of machines
(`bmdb.overview.listing`), the counts per state (`counts`), one machine's
page (`detail`), the operators' audit log (`auditlog`), which machine runs
which node (`nodes`), and the sessions and work outcomes (`sessions`).

A machine an operator holds (`bmdb.actions`) shows who holds it, since
when and why beside its state; `audit` lists the operators' actions.

Every function here reads in one REPEATABLE READ transaction (one to three
statements, one snapshot) through `Connection.transact`, and raises what it
raises (`DatabaseUnavailable`, ...), or `InvalidArgument` for a bad machine
id, state or provider. Nothing here writes.

The names are the package's, each module imported on first use
(`common.lazy`): ``bmdb machines`` reads a page without loading the
machine page's code.
"""

from typing import TYPE_CHECKING

from common.lazy import exports

if TYPE_CHECKING:
    from bmdb.model.history import HISTORY_SQL as HISTORY_SQL
    from bmdb.overview.auditlog import AUDIT_SQL as AUDIT_SQL
    from bmdb.overview.auditlog import MAX_AUDIT as MAX_AUDIT
    from bmdb.overview.auditlog import audit as audit
    from bmdb.overview.counts import STATE_COUNTS_SQL as STATE_COUNTS_SQL
    from bmdb.overview.counts import StateCounts as StateCounts
    from bmdb.overview.counts import state_counts as state_counts
    from bmdb.overview.detail import DETAIL_SQL as DETAIL_SQL
    from bmdb.overview.detail import MAX_HARDWARE_REPORT as MAX_HARDWARE_REPORT
    from bmdb.overview.detail import BackoffRow as BackoffRow
    from bmdb.overview.detail import MachineDetail as MachineDetail
    from bmdb.overview.detail import WorkRow as WorkRow
    from bmdb.overview.detail import detail_params as detail_params
    from bmdb.overview.detail import machine as machine
    from bmdb.overview.listing import MachineState as MachineState
    from bmdb.overview.listing import machine_ids as machine_ids
    from bmdb.overview.listing import machines as machines
    from bmdb.overview.listing import machines_params as machines_params
    from bmdb.overview.listing import machines_sql as machines_sql
    from bmdb.overview.nodes import MAX_NODE_KEYS as MAX_NODE_KEYS
    from bmdb.overview.nodes import NODE_MACHINES_SQL as NODE_MACHINES_SQL
    from bmdb.overview.nodes import machines_of_nodes as machines_of_nodes
    from bmdb.overview.sessions import Activity as Activity
    from bmdb.overview.sessions import SessionRow as SessionRow
    from bmdb.overview.sessions import activity as activity
    from bmdb.overview.states import STATE_FILTERS as STATE_FILTERS
    from bmdb.overview.states import STATE_SQL as STATE_SQL
    from bmdb.overview.states import WAS_INSTALL_STATE_SQL as WAS_INSTALL_STATE_SQL
    from bmdb.overview.states import State as State
    from bmdb.overview.states import parse_state_filter as parse_state_filter
    from bmdb.overview.states import state_prefilter as state_prefilter
else:
    __getattr__ = exports(
        __name__,
        {
            # The machine page's history is the model's statement
            # (`Queries.history`); named here as the page's others are
            # (bench/web_pages.py binds them).
            "bmdb.model.history": ["HISTORY_SQL"],
            "bmdb.overview.auditlog": ["AUDIT_SQL", "MAX_AUDIT", "audit"],
            "bmdb.overview.counts": ["STATE_COUNTS_SQL", "StateCounts", "state_counts"],
            "bmdb.overview.detail": [
                "DETAIL_SQL",
                "MAX_HARDWARE_REPORT",
                "BackoffRow",
                "MachineDetail",
                "WorkRow",
                "detail_params",
                "machine",
            ],
            "bmdb.overview.listing": [
                "MachineState",
                "machine_ids",
                "machines",
                "machines_params",
                "machines_sql",
            ],
            "bmdb.overview.nodes": ["MAX_NODE_KEYS", "NODE_MACHINES_SQL", "machines_of_nodes"],
            "bmdb.overview.sessions": ["Activity", "SessionRow", "activity"],
            "bmdb.overview.states": [
                "STATE_FILTERS",
                "STATE_SQL",
                "WAS_INSTALL_STATE_SQL",
                "State",
                "parse_state_filter",
                "state_prefilter",
            ],
        },
    )

__all__ = [
    "AUDIT_SQL",
    "DETAIL_SQL",
    "HISTORY_SQL",
    "MAX_AUDIT",
    "MAX_HARDWARE_REPORT",
    "MAX_NODE_KEYS",
    "NODE_MACHINES_SQL",
    "STATE_COUNTS_SQL",
    "STATE_FILTERS",
    "STATE_SQL",
    "WAS_INSTALL_STATE_SQL",
    "Activity",
    "BackoffRow",
    "MachineDetail",
    "MachineState",
    "SessionRow",
    "State",
    "StateCounts",
    "WorkRow",
    "activity",
    "audit",
    "detail_params",
    "machine",
    "machine_ids",
    "machines",
    "machines_of_nodes",
    "machines_params",
    "machines_sql",
    "parse_state_filter",
    "state_prefilter",
]
