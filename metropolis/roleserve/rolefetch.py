"""Role fetch: this node's roles, watched from the curators, into the roles value.

Monogon's ``worker_rolefetch.go``, on Trio::

    membership home ─> client to curators (local first, then the directory)
                       Watch(own node) ─> each record's roles ─> roles value

The roles value is persisted by the role server (:mod:`.node`), so a node
restarts with the roles it last saw. Any curator will do: followers name
the leader and the client moves there; when the curator in use stops (the
local one, say, when the control plane goes), the call fails, the runnable
fails, and the supervisor starts it again after its backoff, connecting to
whichever curator answers. A change of membership (a local curator appears
or goes) restarts it at once with the new list.

Cancellation: the runnable is cancelled with the role server; its stream
is cancelled on the curator (RST_STREAM). Errors: :class:`RPCError` from
the curators, raised to the supervisor.
"""

from __future__ import annotations

import trio

from metropolis.event import ReadOnlyValue, Value
from metropolis.identity import NodeCredentials
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import Endpoint, RPCError, Status, client_context, open_client
from metropolis.rpc import api as methods
from metropolis.supervisor import Node

__all__ = ["RoleFetch", "curator_endpoints"]


def curator_endpoints(settings: NodeSettings, membership: ClusterMembership) -> list[Endpoint]:
    """The curators to call: this node's own first when it runs one, then the directory's.

    Every curator of the cluster listens on the same port (this node's
    curator port): Monogon's nodes share one port too.
    """
    endpoints: list[Endpoint] = []
    if membership.local_curator is not None:
        endpoints.append(Endpoint(settings.address, settings.curator_port, membership.public_key))
    directory = membership.remote_curators
    for node in directory.nodes if directory is not None else []:
        for address in node.addresses:
            endpoint = Endpoint(address.host, settings.curator_port, node.public_key)
            if endpoint not in endpoints:
                endpoints.append(endpoint)
    return endpoints


async def wait_home(
    membership: ReadOnlyValue[ClusterMembership],
) -> tuple[ClusterMembership, NodeCredentials]:
    with membership.watch() as watcher:
        current = await watcher.get(lambda m: m.home)
    assert current.credentials is not None  # home means credentials
    return current, current.credentials


async def restart_on_change(
    node: Node, membership: ReadOnlyValue[ClusterMembership], current: ClusterMembership
) -> None:
    """Restart ``node`` when the membership differs from ``current``.

    Services are compared by identity: a restarted curator is a new one.
    """
    with membership.watch() as watcher:
        await watcher.get(
            lambda m: (
                m != current
                or m.local_curator is not current.local_curator
                or m.local_consensus is not current.local_consensus
            )
        )
    node.restart("membership changed")


class RoleFetch:
    """The role-fetch runnable of one node; see the module docstring."""

    def __init__(
        self,
        settings: NodeSettings,
        membership: ReadOnlyValue[ClusterMembership],
        roles: Value[NodeRoles],
    ) -> None:
        self._settings = settings
        self._membership = membership
        self._roles = roles
        self._last: NodeRoles | None = None

    async def run(self, node: Node) -> None:
        current, credentials = await wait_home(self._membership)
        endpoints = curator_endpoints(self._settings, current)
        context = client_context(
            credentials.ca_certificate, credentials.certificate, credentials.private_key
        )
        request = c.WatchRequest(
            node_in_cluster=c.WatchRequestNodeInCluster(node_id=credentials.node_id)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_on_change, node, self._membership, current)
            async with (
                open_client(endpoints, context) as client,
                client.stream(methods.WATCH, request) as call,
            ):
                node.signal_healthy()
                async for event in call:
                    for record in event.nodes:
                        roles = record.roles
                        if record.id != credentials.node_id or roles is None or roles == self._last:
                            continue
                        node.logger.info("roles from the curator: %s", roles)
                        self._last = roles
                        self._roles.set(roles)
            raise RPCError(Status.UNAVAILABLE, "the curator ended the watch")
