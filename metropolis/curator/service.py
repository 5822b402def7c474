"""The curator as a supervised runnable: it follows consensus and campaigns.

::

    curator ── waits for a running consensus status, takes its etcd view
       │   (first, if given, ``before_campaign`` runs on it: a recovery's
       │   preparation of its restored etcd, :mod:`.rejoin`)
       ├── election (in the curator's own task): lease, campaign, lead/follow;
       │   published as ``election`` (and logged "this curator leads") only
       │   once the API listens, so that whoever sees it lead can call it
       └── follower of consensus: a newer consensus status (restarted,
           stopped) means the etcd client in hand is gone -> restart on request

The curator never retries on a client that is gone: a newer consensus
status, or ``EtcdClosed`` from the election, restarts it (``node.restart``,
no backoff), and the restart waits for consensus to run again. So does
``EtcdUnavailable`` (etcd's socket refused or reset), or etcd answering
that it is stopping (``EtcdAPIError.stopping``), when the consensus
status changes within :data:`ETCD_GONE_GRACE`: etcd exits by itself once its
member is removed, a moment before the consensus service notices and says
so, and the curator's calls in that moment are part of the planned stop.
Unavailable without such a change, it fails (the supervisor backs off). The RPC API
is served from here (:mod:`.server`) when the curator has credentials and an
address; it reads :attr:`Curator.election` to know whether to answer or
name the leader.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from metropolis.consensus.client import EtcdAPIError, EtcdClosed, EtcdUnavailable, Lease
from metropolis.consensus.membership import Status
from metropolis.curator.election import (
    DEFAULT_TTL,
    ElectionState,
    Follower,
    Leader,
    run_election,
)
from metropolis.curator.managementapi import HEARTBEAT_TIMEOUT
from metropolis.curator.membership import LEARNER_TIMEOUT
from metropolis.curator.probe import PROBE_ENV, run_probe
from metropolis.curator.rpcerrors import unavailable_consensus
from metropolis.curator.server import CuratorServer
from metropolis.event import ReadOnlyValue, Value, Watcher
from metropolis.identity import NodeCredentials
from metropolis.rpc import Server, server_context
from metropolis.supervisor import Node, RestartRequested

if TYPE_CHECKING:
    # Given only with --metrics-listen (a node without does not import
    # prometheus_client): named for types.
    from metropolis.rpc.metrics import RPCMetrics

__all__ = ["ETCD_GONE_GRACE", "Curator"]

#: Seconds a curator whose etcd became unreachable waits for the consensus
#: status to change (etcd left: the service noticed) before it fails.
ETCD_GONE_GRACE = 5.0


class Curator:
    """This node's curator. ``run`` is a supervisor runnable."""

    def __init__(
        self,
        consensus: ReadOnlyValue[Status],
        node_id: str,
        *,
        ttl: int = DEFAULT_TTL,
        credentials: NodeCredentials | None = None,
        listen: tuple[str, int] | None = None,
        peer_port: int = 7834,
        learner_timeout: float = LEARNER_TIMEOUT,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        lease: Lease | None = None,
        rpc_metrics: RPCMetrics | None = None,
        before_campaign: Callable[[Status], Awaitable[None]] | None = None,
    ):
        """``credentials`` and ``listen`` (host, port): serve the RPC API there.

        ``peer_port`` is the consensus peer port of every node (the cluster
        uses one, as Monogon does): granting ConsensusMember adds a member
        at the node's reported address and this port.

        ``lease``: granted already for the first campaign (the bootstrap
        grants it in the round trip that creates the cluster, one fewer before
        this curator leads); later runs grant their own.

        Without them the curator only campaigns (tests of the election).
        ``heartbeat_timeout``: seconds after a node's last status update at
        which this curator, leading, reports it HEARTBEAT_TIMEOUT.
        ``rpc_metrics``: where the API's calls are counted (as ``curator``).
        ``before_campaign``: awaited with the running consensus status
        before each campaign and before the API is served (nothing of this
        curator uses etcd meanwhile); its errors are the run's.
        """
        self._consensus = consensus
        self.node_id = node_id
        self.ttl = ttl
        self._credentials = credentials
        self._listen = listen
        self._peer_port = peer_port
        self._learner_timeout = learner_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._lease = lease
        self._rpc_metrics = rpc_metrics
        self._before_campaign = before_campaign
        self._port: Value[int] = Value()
        #: The port the RPC API is bound to, once it is.
        self.port: ReadOnlyValue[int] = self._port.readonly()
        self._election: Value[ElectionState] = Value()
        self.election: ReadOnlyValue[ElectionState] = self._election.readonly()

    async def run(self, node: Node) -> None:
        """Run until cancelled; restarts itself (on request) when consensus changes.

        Raises the etcd client's errors other than a closed client, and
        ``EtcdUnavailable`` (or etcd's "stopping" answers) unless the
        consensus status changes within
        :data:`ETCD_GONE_GRACE` of it (the supervisor restarts it with backoff).
        """
        self._election.set(Follower(None))
        with self._consensus.watch() as watcher:
            node.logger.info("waiting for consensus")
            status = await watcher.get(lambda s: s.running)
            try:
                await self._campaign_and_serve(node, watcher, status)
            except BaseException as exc:
                if not _only(exc, _etcd_gone_or_restart):
                    raise
                # etcd went away under the curator: it exits by itself once
                # its member is removed (the leader's consensus revoked), and
                # consensus, which stops the curator for that, notices a
                # moment later. That is the planned stop, not a failure.
                if _contains(exc, RestartRequested):
                    node.restart("consensus changed; its etcd client is gone")
                with trio.move_on_after(ETCD_GONE_GRACE):
                    await watcher.get()
                    node.restart("consensus stopped as its etcd went away")
                raise

    async def _campaign_and_serve(
        self, node: Node, watcher: Watcher[Status], status: Status
    ) -> None:
        """Campaign and serve the API on ``status`` (a running consensus) until cancelled.

        Asks for a restart (raises ``RestartRequested``) when the consensus
        status changes or the etcd client closes.
        """
        if self._before_campaign is not None:
            await self._before_campaign(status)
        kv = status.curator_client()
        node.logger.info("consensus is running; campaigning")
        async with trio.open_nursery() as nursery:

            async def follow_consensus() -> None:
                await watcher.get()
                node.restart("consensus changed; its etcd client is gone")

            # Only the first run: the lease is revoked when a run ends.
            lease, self._lease = self._lease, None
            # The campaign runs beside the API's start, but its outcome is
            # published only once the API listens: whoever sees this
            # curator lead can call it at once.
            campaign: Value[ElectionState] = Value()
            listening = trio.Event()

            async def publish() -> None:
                await listening.wait()
                with campaign.watch() as states:
                    while True:
                        state = await states.get()
                        if isinstance(state, Leader):
                            node.logger.info("this curator leads (term %d)", state.revision)
                        self._election.set(state)

            async def elect() -> None:
                try:
                    await run_election(
                        kv,
                        self.node_id,
                        campaign,
                        ttl=self.ttl,
                        logger=node.logger,
                        lease=lease,
                    )
                except* EtcdClosed:
                    # Also from inside the election's nursery (keep-alive).
                    node.restart("the etcd client closed")

            nursery.start_soon(follow_consensus)
            serve = self._credentials is not None and self._listen is not None
            loaded: list[CuratorServer] = []

            async def load_api() -> None:
                loaded.append(
                    await CuratorServer.load(
                        status,
                        peer_port=self._peer_port,
                        learner_timeout=self._learner_timeout,
                        heartbeat_timeout=self._heartbeat_timeout,
                    )
                )

            nursery.start_soon(publish)
            # The API does not wait for the campaign's lease: until the
            # campaign's outcome is published (after the API listens, see
            # above) it answers as a follower of an unknown leader, as it
            # would while the lease was held and the campaign in flight.
            # The lease is a write, which on a node that has just joined
            # takes both members' fsyncs: waiting for it cost a grant of
            # ConsensusMember that round trip on its critical path; the
            # API's reads go beside it.
            nursery.start_soon(elect)
            listeners: list[trio.SocketListener] = []
            if serve:
                assert self._listen is not None
                host, port = self._listen
                # Bound while the API's reads are in flight (one round
                # trip): a caller that connects meanwhile waits in the
                # listen backlog, not refused; the port is published
                # only once the API serves.
                try:
                    async with trio.open_nursery() as startup:
                        startup.start_soon(load_api)
                        listeners = await trio.open_tcp_listeners(port, host=host)
                except BaseException:
                    # The API failed to load (or we were cancelled) with
                    # the port bound: release it now, not at collection.
                    for listener in listeners:
                        listener.socket.close()
                    raise
            if os.environ.get(PROBE_ENV) == "1":  # test hook: leader-guarded writes
                nursery.start_soon(
                    functools.partial(
                        run_probe, kv, self.election, self.node_id, logger=node.logger
                    )
                )
            if serve:
                assert self._credentials is not None and self._listen is not None
                [api] = loaded
                server = Server(
                    server_context(self._credentials),
                    api.security(),
                    metrics=self._rpc_metrics,
                    name="curator",
                    translate=unavailable_consensus,
                )
                api.register(server)
                # The listeners are bound: a connection made from now on
                # is accepted once the serving task runs. Not waiting for
                # that task to say so spares the nested task starts,
                # each a turn of every other task the new control plane
                # has just started.
                nursery.start_soon(api.serve, server, self.election, listeners)
                bound = listeners[0].socket.getsockname()[1]
                node.logger.info("serving the curator API on %s:%d", self._listen[0], bound)
                self._port.set(bound)
            listening.set()
            node.signal_healthy()


def _etcd_gone_or_restart(exc: BaseException) -> bool:
    """Whether ``exc`` says the curator's etcd went away, or asks for a restart.

    Gone: unreachable, this client closed, or the member answering that it
    is stopping (the requests in flight when a removed member's raft stops).
    """
    if isinstance(exc, EtcdAPIError):
        return exc.stopping
    return isinstance(exc, (EtcdUnavailable, EtcdClosed, RestartRequested))


def _only(exc: BaseException, leaf: Callable[[BaseException], bool]) -> bool:
    """Whether every leaf of ``exc`` (a group or not) satisfies ``leaf``."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(leaf)[1] is None
    return leaf(exc)


def _contains(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether some leaf of ``exc`` (a group or not) is a ``kind``."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(kind)[0] is not None
    return isinstance(exc, kind)
