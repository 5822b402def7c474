"""The node's Prometheus metrics, served at ``http://HOST:PORT/metrics``.

``node bootstrap|register|run --metrics-listen HOST:PORT`` serves them
(plain HTTP/1.1, :mod:`common.metrics`); without it nothing
listens. Not on the debug port: that port speaks gRPC over mutual TLS
and admits only the owner, so a scraper would need the owner's
certificate (the cluster's master credential) and the gRPC server a plain
HTTP path. What is exported is counts and states, nothing secret: node IDs,
runnable names and method paths.

::

    metropolis_etcd_up                         1 when the local etcd member answered this scrape
    metropolis_etcd_has_leader                 its view: a leader exists
    metropolis_etcd_is_leader, metropolis_etcd_is_learner
    metropolis_etcd_leader_changes_seen_total  counted by etcd since its process started
    metropolis_etcd_raft_term
    metropolis_etcd_raft_index, metropolis_etcd_raft_applied_index
    metropolis_etcd_apply_lag_entries          committed but not applied yet
    metropolis_etcd_proposals_pending
    metropolis_etcd_reads_total                reads of the member for these metrics
    metropolis_curator_running                 1 while this node runs a curator
    metropolis_curator_is_leader
    metropolis_curator_term                    the election key's create revision, while leading
    metropolis_curator_leader{node_id}         1: the leader this node's curator sees
    metropolis_curator_leader_changes_total    changes of that leader (this one's included)
    metropolis_curator_elections_won_total
    metropolis_control_plane_running           1 while this node runs consensus and a curator
    metropolis_control_plane_decisions_total{decision}   start, stop, restart
    metropolis_supervisor_restarts_total{runnable, reason}   reason: failure, request
    metropolis_status_push_age_seconds         since the last status push a curator took
    metropolis_status_pushes_total{outcome}    ok, or the refusal's status code
    metropolis_etcd_snapshots_total{outcome}   scheduled snapshots (--snapshot-interval): ok, failed
    metropolis_etcd_snapshot_age_seconds       since the last scheduled snapshot was written
    metropolis_rpc_calls_total{server, method, code}, metropolis_rpc_call_duration_seconds
                                               (see metropolis.rpc.metrics)

etcd is read when scraped (:func:`~metropolis.consensus.metrics.read_member`,
bounded by ``etcd_timeout``); a member that does not answer in time shows
``metropolis_etcd_up 0`` and no other etcd sample. Scrapes at once share one
read, and a read serves the scrapes of the next ``etcd_max_age`` seconds
too: however often anyone scrapes, etcd is asked at most once in that time. Everything else is read
from counters the node's tasks keep, in the Trio thread.

Cancellation: cancelling :meth:`NodeMetrics.run` closes the listener.
Errors: OSError when the address cannot be bound, raised to the
supervisor, which retries after its backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import serve_metrics
from metropolis.consensus.metrics import MemberMetrics, read_member
from metropolis.curator.election import ElectionState, Leader
from metropolis.curator.service import Curator
from metropolis.errors import ConsensusError
from metropolis.event import ReadOnlyValue
from metropolis.roleserve.controlplane import ControlPlaneWorker
from metropolis.roleserve.snapshots import SnapshotSchedule
from metropolis.roleserve.statuspush import StatusPush
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import RPCMetrics
from metropolis.supervisor import Node

__all__ = ["NodeMetrics"]

_log = logging.getLogger("metropolis.roleserve.metrics")


@dataclass
class _CuratorView:
    """What this node's curators saw of the election, across their restarts."""

    leader: str | None = None
    term: int | None = None
    is_leader: bool = False
    leader_changes: int = 0
    elections_won: int = 0

    def see(self, state: ElectionState) -> None:
        if isinstance(state, Leader):
            leader: str | None = state.node_id
            if not self.is_leader or self.term != state.revision:
                self.elections_won += 1
            self.is_leader, self.term = True, state.revision
        else:
            leader = state.leader.node_id if state.leader is not None else None
            self.is_leader, self.term = False, None
            if leader is None:
                return  # unknown, or an election under way: no change seen yet
        if leader != self.leader:
            if self.leader is not None:
                self.leader_changes += 1
            self.leader = leader


class NodeMetrics(Collector):
    """The metrics of one node; see the module docstring.

    Create it before the components it counts (``rpc`` goes to their RPC
    servers), then :meth:`attach` the role server's parts and run
    :meth:`run` as a supervised runnable.
    """

    def __init__(
        self, listen: str, *, etcd_timeout: float = 2.0, etcd_max_age: float = 1.0
    ) -> None:
        self.listen = listen
        self.rpc = RPCMetrics()
        self._etcd_timeout = etcd_timeout
        self._etcd_max_age = etcd_max_age
        self._etcd_lock = trio.Lock()
        self._etcd_read_at = -float("inf")
        #: etcd reads made (for tests and diagnostics).
        self.etcd_reads = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.rpc)
        self.registry.register(self)
        self._worker: ControlPlaneWorker | None = None
        self._push: StatusPush | None = None
        self._snapshots: SnapshotSchedule | None = None
        self._membership: ReadOnlyValue[ClusterMembership] | None = None
        self._node: Node | None = None
        self._now: ClusterMembership | None = None
        self._curator = _CuratorView()
        self._etcd: MemberMetrics | None = None
        #: The URL base once listening (``http://HOST:PORT``).
        self.url: str | None = None

    def attach(
        self,
        worker: ControlPlaneWorker,
        push: StatusPush,
        membership: ReadOnlyValue[ClusterMembership],
        snapshots: SnapshotSchedule | None = None,
    ) -> None:
        self._worker, self._push, self._membership = worker, push, membership
        self._snapshots = snapshots

    async def run(self, node: Node) -> None:
        assert self._membership is not None, "attach() first"
        self._node = node
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_membership, nursery)
            urls = await nursery.start(
                lambda task_status: serve_metrics(
                    self.registry, self.listen, refresh=self._refresh, task_status=task_status
                )
            )
            self.url = urls[0]
            node.logger.info("metrics at %s/metrics", self.url)
            node.signal_healthy()

    async def _follow_membership(self, nursery: trio.Nursery) -> None:
        assert self._membership is not None
        watched: Curator | None = None
        scope: trio.CancelScope | None = None
        with self._membership.watch() as watcher:
            while True:
                self._now = await watcher.get()
                curator = self._now.local_curator
                if curator is not watched:
                    if scope is not None:
                        scope.cancel()
                    watched, scope = curator, None
                    if curator is not None:
                        scope = await nursery.start(self._follow_election, curator)

    async def _follow_election(
        self, curator: Curator, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope, curator.election.watch() as states:
            task_status.started(scope)
            while True:
                self._curator.see(await states.get())

    async def _refresh(self) -> None:
        """Read the local etcd member, if there is one and the last read is too old."""
        async with self._etcd_lock:
            if trio.current_time() - self._etcd_read_at < self._etcd_max_age:
                return
            self._etcd = None
            consensus = self._now.local_consensus if self._now is not None else None
            if consensus is None:
                return
            self.etcd_reads += 1
            with trio.move_on_after(self._etcd_timeout):
                try:
                    self._etcd = await read_member(
                        consensus.config.client_socket, call_timeout=self._etcd_timeout
                    )
                except ConsensusError as e:
                    _log.debug("etcd not read: %s", e)
            self._etcd_read_at = trio.current_time()

    def collect(self) -> Iterator[Metric]:
        yield from self._collect_etcd()
        yield from self._collect_curator()
        yield from self._collect_roles()

    def _collect_etcd(self) -> Iterator[Metric]:
        etcd = self._etcd
        consensus = self._now is not None and self._now.local_consensus is not None
        if consensus:
            yield _gauge("metropolis_etcd_up", "The local etcd member answered.", etcd is not None)
        yield CounterMetricFamily(
            "metropolis_etcd_reads",
            "Reads of the local etcd member for these metrics.",
            value=self.etcd_reads,
        )
        if etcd is None:
            return
        yield _gauge("metropolis_etcd_has_leader", "The member knows a leader.", etcd.has_leader)
        yield _gauge("metropolis_etcd_is_leader", "The member is the raft leader.", etcd.is_leader)
        yield _gauge("metropolis_etcd_is_learner", "The member does not vote yet.", etcd.is_learner)
        yield CounterMetricFamily(
            "metropolis_etcd_leader_changes_seen",
            "Leader changes the member has seen since its process started.",
            value=etcd.leader_changes_seen,
        )
        yield _gauge("metropolis_etcd_raft_term", "The member's raft term.", etcd.raft_term)
        yield _gauge("metropolis_etcd_raft_index", "Last committed raft index.", etcd.raft_index)
        yield _gauge(
            "metropolis_etcd_raft_applied_index",
            "Last applied raft index.",
            etcd.raft_applied_index,
        )
        yield _gauge(
            "metropolis_etcd_apply_lag_entries",
            "Raft entries committed but not applied yet.",
            etcd.apply_lag,
        )
        yield _gauge(
            "metropolis_etcd_proposals_pending",
            "Proposals not committed yet.",
            etcd.proposals_pending,
        )

    def _collect_curator(self) -> Iterator[Metric]:
        view = self._curator
        running = self._now is not None and self._now.local_curator is not None
        yield _gauge("metropolis_curator_running", "This node runs a curator.", running)
        if running:
            yield _gauge("metropolis_curator_is_leader", "This curator leads.", view.is_leader)
            if view.term is not None:
                yield _gauge(
                    "metropolis_curator_term",
                    "Create revision of the election key of this curator's term.",
                    view.term,
                )
            leader = GaugeMetricFamily(
                "metropolis_curator_leader",
                "The leading curator this node's curator sees.",
                labels=["node_id"],
            )
            if view.leader is not None:
                leader.add_metric([view.leader], 1)
            yield leader
        yield CounterMetricFamily(
            "metropolis_curator_leader_changes",
            "Changes of the leading curator, seen by this node's curators.",
            value=view.leader_changes,
        )
        yield CounterMetricFamily(
            "metropolis_curator_elections_won",
            "Terms this node's curators won.",
            value=view.elections_won,
        )

    def _collect_roles(self) -> Iterator[Metric]:
        running = self._now is not None and self._now.local_consensus is not None
        yield _gauge(
            "metropolis_control_plane_running", "This node runs consensus and a curator.", running
        )
        if self._worker is not None:
            decisions = CounterMetricFamily(
                "metropolis_control_plane_decisions",
                "The role server's control-plane decisions (start, stop, restart).",
                labels=["decision"],
            )
            for decision, n in sorted(self._worker.decisions.items()):
                decisions.add_metric([decision], n)
            yield decisions
        if self._node is not None:
            restarts = CounterMetricFamily(
                "metropolis_supervisor_restarts",
                "Restarts of supervised runnables, after a failure or on request.",
                labels=["runnable", "reason"],
            )
            for (name, why), n in sorted(self._node.tree_restart_totals().items()):
                restarts.add_metric([name, why], n)
            yield restarts
        if self._push is not None:
            if self._push.last_pushed is not None:
                yield _gauge(
                    "metropolis_status_push_age_seconds",
                    "Seconds since a curator last took this node's status.",
                    trio.current_time() - self._push.last_pushed,
                )
            pushes = CounterMetricFamily(
                "metropolis_status_pushes",
                "Status pushes by outcome (ok, or the refusal's status code).",
                labels=["outcome"],
            )
            for outcome, n in sorted(self._push.pushes.items()):
                pushes.add_metric([outcome], n)
            yield pushes
        if self._snapshots is not None:
            snapshots = CounterMetricFamily(
                "metropolis_etcd_snapshots",
                "Scheduled etcd snapshots by outcome (ok, failed).",
                labels=["outcome"],
            )
            for outcome, n in sorted(self._snapshots.outcomes.items()):
                snapshots.add_metric([outcome], n)
            yield snapshots
            if self._snapshots.last_taken is not None:
                yield _gauge(
                    "metropolis_etcd_snapshot_age_seconds",
                    "Seconds since the last scheduled etcd snapshot was written.",
                    trio.current_time() - self._snapshots.last_taken,
                )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))
