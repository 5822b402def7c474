"""The node's debug service: what this node runs, for the owner, on every node.

Every node, with or without a curator, serves ``NodeDebug`` on its debug
port (:attr:`~.disk.NodeSettings.debug_port`, reported to the curators in
its status so that the owner can find it)::

    GetSupervisionTree  -> this node's Supervisor snapshot: every runnable's
                           dotted name, state, restarts, last error and when

It is read-only and says nothing secret (names, states and one-line
errors). It speaks the curator's RPC (gRPC, mutual TLS with the node
certificate, :mod:`metropolis.rpc`) and admits only the owner
(``Access.OWNER``; a node certificate gets PERMISSION_DENIED, a certificate
of another CA fails the handshake). A node without a curator has no etcd
to read the owner key from, so the owner is recognised by its certificate
(``ServerSecurity.owner_by_name``, see :mod:`metropolis.rpc.auth` for why
that is as strong). Not checked: the cluster CRL, which lives in etcd and
only curators follow (nothing revokes an owner certificate today).

The service starts once the node is home: a node that is still
registering has no certificate to serve with.

Cancellation: cancelled with the role server; the listener closes.
Errors: OSError when the port cannot be bound, raised to the supervisor,
which retries after its backoff.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import trio

from metropolis.event import ReadOnlyValue
from metropolis.proto import management as m
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import (
    CallContext,
    Leadership,
    Server,
    ServerSecurity,
    methods,
    server_context,
)
from metropolis.supervisor import Node, RunnableInfo

if TYPE_CHECKING:
    # Given only with --metrics-listen (a node without does not import
    # prometheus_client): named for types.
    from metropolis.rpc.metrics import RPCMetrics

__all__ = ["DebugService", "supervision_tree"]


def supervision_tree(node_id: str, snapshot: list[RunnableInfo]) -> m.GetSupervisionTreeResponse:
    """``snapshot`` (:meth:`Supervisor.snapshot`) as the wire message."""
    return m.GetSupervisionTreeResponse(
        node_id=node_id,
        runnables=[
            m.SupervisedRunnable(
                name=r.name,
                state=m.SupervisedRunnableState[r.state.name],
                restarts=r.restarts,
                last_error=r.last_error or "",
                last_error_at=(
                    None
                    if r.last_error_at is None
                    else datetime.datetime.fromtimestamp(r.last_error_at, datetime.UTC)
                ),
            )
            for r in snapshot
        ],
    )


class DebugService:
    """The debug-service runnable of one node; see the module docstring."""

    def __init__(
        self,
        settings: NodeSettings,
        membership: ReadOnlyValue[ClusterMembership],
        rpc_metrics: RPCMetrics | None = None,
    ) -> None:
        """``rpc_metrics``: where calls are counted (as ``debug``)."""
        self._rpc_metrics = rpc_metrics
        self._settings = settings
        self._membership = membership

    async def run(self, node: Node) -> None:
        with self._membership.watch() as watcher:
            current = await watcher.get(lambda mem: mem.home)
        credentials = current.credentials
        assert credentials is not None  # home means credentials

        async def get_supervision_tree(
            request: m.GetSupervisionTreeRequest, ctx: CallContext
        ) -> m.GetSupervisionTreeResponse:
            return supervision_tree(credentials.node_id, node.tree_snapshot())

        security = ServerSecurity(
            owner_key=lambda: None,
            crl=lambda: None,
            # Unused: the method is not leader-only; every node answers for itself.
            leadership=lambda: Leadership(True),
            owner_by_name=True,
        )
        server = Server(
            server_context(credentials), security, metrics=self._rpc_metrics, name="debug"
        )
        server.unary(methods.GET_SUPERVISION_TREE, get_supervision_tree)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                server.serve, self._settings.address, self._settings.debug_port
            )
            node.logger.info("debug service on %s:%d", self._settings.address, port)
            node.signal_healthy()
