"""Role fetch: this node's roles, watched from the curators, into the roles value.

Monogon's ``worker_rolefetch.go``, on Trio::

    membership home ─> client to curators (local first, then the directory)
                       Watch(own node) ─> each record's roles ─> roles value

Each new set of roles is made durable on the node's disk *before* it is
published: the control-plane worker acts on the roles value (starts etcd
on join data, or stops it and wipes its data), so the disk must never be
behind what the node did. Otherwise a crash right after a join (etcd
started, perhaps promoted to a voter that acknowledged writes) would
restart the node on its old roles, which say "no control plane": it would
wipe the data of a voting member. So a node restarts with at least the
roles it last acted on. Any curator will do: followers name
the leader and the client moves there; when the curator in use stops (the
local one, say, when the control plane goes), the call fails, the runnable
fails, and the supervisor starts it again after its backoff, connecting to
whichever curator answers. A change of membership restarts it with the new
list: at once when the local curator goes, and once it serves when one
appears (:func:`restart_on_change`).

Cancellation: the runnable is cancelled with the role server; its stream
is cancelled on the curator (RST_STREAM). Errors: :class:`RPCError` from
the curators other than UNAVAILABLE, raised to the supervisor.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace

import trio

from metropolis.curator.service import Curator
from metropolis.event import Closed, ReadOnlyValue, Value, Watcher
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles, role_names
from metropolis.roleserve import disk
from metropolis.roleserve.curatorloss import follow_curators
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.startup import ControlPlaneStartup, has_control_plane
from metropolis.roleserve.values import ClusterMembership
from metropolis.rpc import Client, Endpoint, client_context, methods
from metropolis.supervisor import Node

__all__ = ["RoleFetch", "curator_endpoints", "latest_endpoints"]


def curator_endpoints(settings: NodeSettings, membership: ClusterMembership) -> list[Endpoint]:
    """The curators to call: this node's own first when it runs one, then the directory's.

    Every curator of the cluster listens on the same port (this node's
    curator port): Monogon's nodes share one port too. A directory entry
    without a public key (learnt by :mod:`.directory`) is dialled by
    address alone; TLS still demands a node certificate of the cluster.
    """
    endpoints: list[Endpoint] = []
    if membership.local_curator is not None:
        endpoints.append(Endpoint(settings.address, settings.curator_port, membership.public_key))
    directory = membership.remote_curators
    for node in directory.nodes if directory is not None else []:
        for address in node.addresses:
            endpoint = Endpoint(address.host, settings.curator_port, node.public_key or None)
            if endpoint not in endpoints:
                endpoints.append(endpoint)
    return endpoints


#: How long to wait for this node's own curator to listen before calling
#: the directory's curators without it. A node that is to run a curator
#: (bootstrap data, or a ConsensusMember role, perhaps persisted from its
#: last life) is named in its own directory, and calling that address
#: before the curator serves fails: the supervisor would log the failure
#: with a traceback on every start of a control-plane node. The wait ends
#: on the events themselves (the decision, the curator in the membership,
#: its port bound); this is only the bound for a curator that never comes
#: (e.g. etcd cannot join), after which the other curators are called.
LOCAL_CURATOR_WAIT = 10.0


async def wait_home(
    membership: ReadOnlyValue[ClusterMembership],
    startup: ReadOnlyValue[ControlPlaneStartup] | None = None,
) -> tuple[ClusterMembership, NodeCredentials]:
    """The first home membership, once its local curator (if any) serves.

    ``startup`` is the control-plane worker's decision: when it says this
    node runs a control plane, the membership that names the local curator
    is waited for too (a node restarting from disk is home at once, before
    its curator exists). Waits at most :data:`LOCAL_CURATOR_WAIT` for all
    that; then returns the home membership it has. Cancellable.
    """
    with membership.watch() as watcher:
        current = await watcher.get(lambda m: m.home)
        with trio.move_on_after(LOCAL_CURATOR_WAIT), contextlib.suppress(Closed):
            if startup is not None and current.local_curator is None:
                with startup.watch() as decision:
                    runs_curator = has_control_plane(await decision.get())
                if runs_curator:
                    current = await watcher.get(lambda m: m.home and m.local_curator is not None)
            if current.local_curator is not None:
                with current.local_curator.port.watch() as port:
                    await port.get()
    assert current.credentials is not None  # home means credentials
    return current, current.credentials


def latest_endpoints(
    settings: NodeSettings, membership: ReadOnlyValue[ClusterMembership]
) -> Callable[[], Awaitable[list[Endpoint]]]:
    """The curators to call, from the membership as it is when asked (the newest directory)."""

    async def endpoints() -> list[Endpoint]:
        with membership.watch() as watcher:
            return curator_endpoints(settings, await watcher.get())

    return endpoints


async def restart_on_change(
    node: Node, membership: ReadOnlyValue[ClusterMembership], current: ClusterMembership
) -> None:
    """Restart ``node`` when the membership differs from ``current``; a new local
    curator counts only once it serves.

    Services are compared by identity: a restarted curator is a new one.
    A new directory alone does not count: a connected client has no use
    for it, and one that loses its curator reconnects with the newest
    directory (:func:`latest_endpoints`; :mod:`.directory` updates it).

    Why wait for a new local curator to serve (its port published): until
    then the curators in use still serve this node, and a restarted caller
    would only wait for the new one (:func:`wait_home`). On a grant of
    ConsensusMember that restart (streams cancelled, connections closed)
    fell into the joining etcd's start, the grant's critical path, on the
    same cores; and the status push said "curator on" before it was. If the
    membership changes again meanwhile (the control plane stops before its
    curator served), the newest membership is judged instead.
    """
    in_use = current.local_curator
    with membership.watch() as watcher:
        latest = await watcher.get(lambda m: _differs(m, current))
        while (curator := latest.local_curator) is not None and curator is not in_use:
            newer = await _serving_or_newer(curator, watcher)
            if newer is None:
                break  # it serves
            # Back to what the caller has (say, the new curator went before
            # it served): nothing to restart for, yet.
            changed = _differs(newer, current)
            latest = newer if changed else await watcher.get(lambda m: _differs(m, current))
    node.restart("membership changed")


def _differs(m: ClusterMembership, current: ClusterMembership) -> bool:
    return (
        replace(m, remote_curators=None) != replace(current, remote_curators=None)
        or m.local_curator is not current.local_curator
        or m.local_consensus is not current.local_consensus
    )


async def _serving_or_newer(
    curator: Curator, watcher: Watcher[ClusterMembership]
) -> ClusterMembership | None:
    """None once ``curator`` publishes its port; the next membership if that comes first."""
    newer: ClusterMembership | None = None
    async with trio.open_nursery() as nursery:

        async def serving() -> None:
            with curator.port.watch() as port:
                await port.get()
            nursery.cancel_scope.cancel()

        async def changed() -> None:
            nonlocal newer
            # Cancellation-safe: a membership set as the port comes is not lost.
            newer = await watcher.get()
            nursery.cancel_scope.cancel()

        nursery.start_soon(serving)
        nursery.start_soon(changed)
    return newer


class RoleFetch:
    """The role-fetch runnable of one node; see the module docstring."""

    def __init__(
        self,
        root: Root,
        settings: NodeSettings,
        membership: ReadOnlyValue[ClusterMembership],
        roles: Value[NodeRoles],
        startup: ReadOnlyValue[ControlPlaneStartup] | None = None,
    ) -> None:
        """``root``: where the roles are saved before they are published.
        ``startup``: the control-plane worker's decision (see :func:`wait_home`)."""
        self._root = root
        self._settings = settings
        self._membership = membership
        self._roles = roles
        self._startup = startup
        self._last: NodeRoles | None = None

    async def run(self, node: Node) -> None:
        current, credentials = await wait_home(self._membership, self._startup)
        context = client_context(
            credentials.ca_certificate, credentials.certificate, credentials.private_key
        )
        request = c.WatchRequest(
            node_in_cluster=c.WatchRequestNodeInCluster(node_id=credentials.node_id)
        )

        async def session(client: Client, connected: Callable[[], None]) -> None:
            async with client.stream(methods.WATCH, request) as call:
                connected()
                async for event in call:
                    for record in event.nodes:
                        roles = record.roles
                        if record.id != credentials.node_id or roles is None or roles == self._last:
                            continue
                        node.logger.info(
                            "roles from the curator: %s", ", ".join(role_names(roles)) or "none"
                        )
                        # Durable first: see the module docstring.
                        await trio.to_thread.run_sync(
                            functools.partial(disk.save_roles, self._root, roles)
                        )
                        self._last = roles
                        self._roles.set(roles)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_on_change, node, self._membership, current)
            await follow_curators(
                node,
                "role fetch",
                latest_endpoints(self._settings, self._membership),
                context,
                session,
            )
