"""Directory update: keep this node's cluster directory at the curators' current set.

The cluster directory (who runs a curator, at which address) is what a
node dials when its own curator is not there. Saved once at bootstrap or
register, it would name only the curators of that moment: the bootstrap
node's names itself alone, so once its ConsensusMember role is revoked (its
curator stops) it could reach nobody. This runnable follows the curators::

    membership home ─> client to curators (local first, then the directory)
                       Watch(nodes_in_cluster) ─> nodes with a running curator
                       and an address ─> directory changed?
                           ─> esp/cluster_directory.pb (atomic) ─> membership

A directory is published only once the backlog (every node at the start of
the watch) is in, and never empty: a cluster whose nodes have not reported
yet must not leave this node with nobody to call. Public keys are kept for
nodes the old directory knew (the client then insists on them); nodes learnt
here are reached by address, the TLS handshake still requiring a node
certificate of this cluster.

Role fetch and status push do not restart on a new directory (see
:func:`.rolefetch.restart_on_change`): they read it when they (re)connect.

Cancellation: cancelled with the role server. Errors: the stream breaks
when the curator in use stops: one WARNING, and the watch is opened again
on any curator of the newest directory (:mod:`.curatorloss`). Other
:class:`RPCError` from the curators is raised to the supervisor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import trio

from metropolis import identity
from metropolis.event import ReadOnlyValue, Value
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
)
from metropolis.roleserve.curatorloss import follow_curators
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.rolefetch import latest_endpoints, restart_on_change, wait_home
from metropolis.roleserve.startup import ControlPlaneStartup
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import Client, client_context, methods
from metropolis.supervisor import Node

__all__ = ["DirectoryUpdate", "directory_of"]


def directory_of(curators: dict[str, str], known: ClusterDirectory | None) -> ClusterDirectory:
    """The directory of ``curators`` (node ID -> address), keys taken from ``known``.

    Sorted by node ID, so that the same set always gives the same bytes.
    """
    keys = {
        identity.node_id(n.public_key): n.public_key
        for n in (known.nodes if known else [])
        if len(n.public_key) == 32  # entries learnt here have none
    }
    return ClusterDirectory(
        nodes=[
            ClusterDirectoryNode(
                public_key=keys.get(node_id, b""),
                addresses=[ClusterDirectoryNodeAddress(host=address)],
            )
            for node_id, address in sorted(curators.items())
        ]
    )


class DirectoryUpdate:
    """The directory-update runnable of one node; see the module docstring."""

    def __init__(
        self,
        root: Root,
        settings: NodeSettings,
        membership: Value[ClusterMembership],
        startup: ReadOnlyValue[ControlPlaneStartup] | None = None,
    ) -> None:
        """``startup``: the control-plane worker's decision (see :func:`.wait_home`)."""
        self._root = root
        self._settings = settings
        self._membership = membership
        self._startup = startup

    async def run(self, node: Node) -> None:
        current, credentials = await wait_home(self._membership.readonly(), self._startup)
        context = client_context(
            credentials.ca_certificate, credentials.certificate, credentials.private_key
        )
        request = c.WatchRequest(nodes_in_cluster=c.WatchRequestNodesInCluster())

        async def session(client: Client, connected: Callable[[], None]) -> None:
            async with client.stream(methods.WATCH, request) as call:
                connected()
                curators: dict[str, str] = {}
                backlogged = False
                async for event in call:
                    for record in event.nodes:
                        status = record.status
                        if status and status.external_address and status.running_curator:
                            curators[record.id] = status.external_address
                        else:
                            curators.pop(record.id, None)
                    for tombstone in event.node_tombstones:
                        curators.pop(tombstone.node_id, None)
                    backlogged |= event.progress == c.WatchEventProgress.LAST_BACKLOGGED
                    if backlogged and curators:
                        await self._publish(node, curators)

        membership = self._membership.readonly()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_on_change, node, membership, current)
            await follow_curators(
                node,
                "directory update",
                latest_endpoints(self._settings, membership),
                context,
                session,
            )

    async def _publish(self, node: Node, curators: dict[str, str]) -> None:
        with self._membership.watch() as watcher:
            before = await watcher.get()
        directory = directory_of(curators, before.remote_curators)
        if before.remote_curators is not None and bytes(directory) == bytes(before.remote_curators):
            return
        await trio.to_thread.run_sync(
            functools.partial(self._root.esp.write_cluster_directory, directory)
        )
        # Only this field of the newest membership: the launcher may have
        # published its local services meanwhile, and they must stay.
        self._membership.update(lambda latest: replace(latest, remote_curators=directory))
        node.logger.info("cluster directory: %s", ", ".join(sorted(curators.values())))
