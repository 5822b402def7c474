"""Prometheus metrics of a BMDB client and of the fleet in its BMDB.

Two collectors for a ``prometheus_client.CollectorRegistry``:

`ConnectionCollector` exports the counters a `Connection` keeps in its
`Stats` (no extra bookkeeping on the hot path: collection reads them)::

    bmdb_sessions_started_total{component}
    bmdb_transactions_executed_total{connection}     committed
    bmdb_transactions_retried_total{connection}      serialization failures, deadlocks
    bmdb_transactions_failed_total{connection}       retries exhausted, database errors
    bmdb_work_started_total{component, process}
    bmdb_work_finished_total{component, process, result}   Finished / Failed / Canceled
    bmdb_work_claim_conflicts_total{connection}
    bmdb_work_nothing_to_do_total{connection}

Sessions and work are labelled with their session's component; transactions
are not tied to a session, so they carry the ``connection`` name given to
the collector (one per long-running command). Every label value comes from
code (component names, `Process`, results): no machine ids.

`FleetGauges` runs one statement (`FLEET_SQL`) every ``period`` seconds and
exports its last answer::

    bmdb_fleet_machines, bmdb_fleet_machines_provided,
    bmdb_fleet_machines_agent_started, bmdb_fleet_machines_heartbeating,
    bmdb_fleet_work_active{process}, bmdb_fleet_backoffs_active{process},
    bmdb_fleet_machines_installation{state}   installing, installed, install-failed, install-lost
                                              (tombstones not counted)
    bmdb_fleet_machines_decommissioned        tombstones (`bmdb.overview` state
                                              decommissioned)
    bmdb_fleet_query_duration_seconds, bmdb_fleet_updated_timestamp_seconds

Collectors must be collected in the Trio thread (see `common.metrics`):
they read counters that Trio tasks update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import BMDBError
from bmdb.model import InstallState, Process, Queries
from bmdb.model.installs import INSTALL_STATE_SQL
from bmdb.transaction import Isolation

logger = logging.getLogger("bmdb.metrics")

#: Results of closed work, as the history names them.
RESULTS = ("Finished", "Failed", "Canceled")

#: Seconds between two fleet queries unless told otherwise.
DEFAULT_FLEET_PERIOD = 15.0

#: The fleet gauges in one statement. Heartbeating: within 10 minutes (what
#: recovery considers alive). Work counts only locks of live sessions.
FLEET_SQL = f"""
SELECT (SELECT count(*) FROM machines),
       (SELECT count(*) FROM machine_provided),
       (SELECT count(*) FROM machine_agent_started),
       (SELECT count(*) FROM machine_agent_heartbeat
        WHERE agent_heartbeat_at >= now() - interval '10 minutes'),
       ARRAY(SELECT w.process::text || '=' || count(*) FROM work w
             JOIN sessions s ON s.session_id = w.session_id
             WHERE s.session_deadline > now() GROUP BY w.process),
       ARRAY(SELECT b.process::text || '=' || count(*) FROM work_backoff b
             WHERE b.until > now() GROUP BY b.process),
       ARRAY(SELECT i.state || '=' || count(*) FROM (
                 SELECT {INSTALL_STATE_SQL} AS state FROM machine_os_installation_request oq
                 LEFT JOIN machine_os_installation_report orp ON orp.machine_id = oq.machine_id
                 WHERE NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                   WHERE dc.machine_id = oq.machine_id
                                     AND dc.decommissioned_at IS NOT NULL)
             ) i GROUP BY i.state),
       (SELECT count(*) FROM machine_decommission WHERE decommissioned_at IS NOT NULL)
"""


class ConnectionCollector(Collector):
    """Exports ``conn.stats`` (see the module docstring)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._name = name

    def collect(self) -> Iterator[Metric]:
        stats = self._conn.stats
        conn_label = [self._name]

        def per_connection(name: str, doc: str, value: int) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["connection"])
            family.add_metric(conn_label, value)
            return family

        yield per_connection("bmdb_transactions_executed", "Transactions committed.", stats.commits)
        yield per_connection(
            "bmdb_transactions_retried",
            "Transaction attempts that hit a serialization failure or deadlock and ran again.",
            stats.retries,
        )
        yield per_connection(
            "bmdb_transactions_failed",
            "Transactions given up: retries exhausted or a database error.",
            stats.failed,
        )
        yield per_connection(
            "bmdb_work_claim_conflicts",
            "Work claims refused because the machine had live work.",
            stats.conflicts,
        )
        yield per_connection(
            "bmdb_work_nothing_to_do", "Work sources that found no machine.", stats.nothing_to_do
        )
        sessions = CounterMetricFamily(
            "bmdb_sessions_started", "BMDB sessions started.", labels=["component"]
        )
        for component, n in sorted(stats.sessions_started.items()):
            sessions.add_metric([component], n)
        yield sessions
        started = CounterMetricFamily(
            "bmdb_work_started", "Work claimed on a machine.", labels=["component", "process"]
        )
        for (component, process), n in sorted(stats.work_started.items()):
            started.add_metric([component, process], n)
        yield started
        finished = CounterMetricFamily(
            "bmdb_work_finished",
            "Work closed, by result (Finished, Failed, Canceled).",
            labels=["component", "process", "result"],
        )
        for (component, process, result), n in sorted(stats.work_finished.items()):
            finished.add_metric([component, process, result], n)
        yield finished


@dataclass(frozen=True)
class FleetSnapshot:
    """One answer of `FLEET_SQL`."""

    machines: int
    provided: int
    agent_started: int
    heartbeating: int
    work: dict[str, int] = field(default_factory=dict)
    backoffs: dict[str, int] = field(default_factory=dict)
    #: Machines by installation state (those with a request, tombstones not).
    installation: dict[str, int] = field(default_factory=dict)
    #: Tombstones: machines decommissioned.
    decommissioned: int = 0


async def fleet_snapshot(conn: Connection) -> FleetSnapshot:
    """Run `FLEET_SQL` once. Raises what `Connection.transact` raises."""

    async def body(q: Queries) -> list[Row]:
        return await q.execute(FLEET_SQL)

    [r] = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)

    def pairs(items: list[str]) -> dict[str, int]:
        return {k: int(v) for k, _, v in (i.rpartition("=") for i in items)}

    return FleetSnapshot(r[0], r[1], r[2], r[3], pairs(r[4]), pairs(r[5]), pairs(r[6]), r[7])


class FleetGauges(Collector):
    """The fleet gauges; `run` keeps them fresh. Until the first query
    answers, nothing is exported (rather than zeros that look like data)."""

    def __init__(self, conn: Connection, period: float = DEFAULT_FLEET_PERIOD) -> None:
        self._conn = conn
        self.period = period
        self.snapshot: FleetSnapshot | None = None
        #: Seconds the last query took.
        self.duration = 0.0
        self._updated = 0.0

    async def update(self) -> None:
        """Query the fleet once now."""
        started = time.perf_counter()
        snapshot = await fleet_snapshot(self._conn)
        self.duration = time.perf_counter() - started
        self._updated = time.time()
        self.snapshot = snapshot

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Update every `period` seconds until cancelled; ``task_status.started``
        after the first attempt (so that a scrape right after startup has the
        gauges). A failed query is logged and the previous values stay (their
        timestamp shows their age)."""
        while True:
            try:
                await self.update()
            except BMDBError as e:
                logger.warning("fleet query failed: %s", e)
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            await trio.sleep(self.period)

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        for name, doc, value in (
            ("bmdb_fleet_machines", "Machines in the BMDB.", s.machines),
            ("bmdb_fleet_machines_provided", "Machines with a provider tag.", s.provided),
            (
                "bmdb_fleet_machines_agent_started",
                "Machines whose agent was started.",
                s.agent_started,
            ),
            (
                "bmdb_fleet_machines_heartbeating",
                "Machines whose agent sent a heartbeat in the last 10 minutes.",
                s.heartbeating,
            ),
            (
                "bmdb_fleet_machines_decommissioned",
                "Machines decommissioned (tombstones kept with their history).",
                s.decommissioned,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, values in (
            ("bmdb_fleet_work_active", "Work locks held by live sessions.", s.work),
            ("bmdb_fleet_backoffs_active", "Backoffs not yet over.", s.backoffs),
        ):
            family = GaugeMetricFamily(name, doc, labels=["process"])
            for process in Process:
                family.add_metric([process], values.get(process, 0))
            yield family
        installation = GaugeMetricFamily(
            "bmdb_fleet_machines_installation",
            "Machines asked to install an OS, by installation state.",
            labels=["state"],
        )
        for state in InstallState:
            installation.add_metric([state], s.installation.get(state, 0))
        yield installation
        yield GaugeMetricFamily(
            "bmdb_fleet_query_duration_seconds",
            "How long the last fleet query took.",
            value=self.duration,
        )
        yield GaugeMetricFamily(
            "bmdb_fleet_updated_timestamp_seconds",
            "When the fleet gauges were last updated (Unix time).",
            value=self._updated,
        )
