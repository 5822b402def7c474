"""A whole node: its role server values, the control-plane worker, persisted roles.

::

    root ── role ──┬── controlplane ──┬── map-*, reduce (a group)
                   │                  └── launcher ──┬── consensus (etcd)
                   │                                 └── curator
                   ├── persist-roles: roles ──> data/node/roles.pb
                   ├── rolefetch: Watch(own node) at the curators ──> roles
                   ├── directory: Watch(all nodes) ──> cluster directory (disk, membership)
                   ├── statuspush: address, curator running, image ──> UpdateNodeStatus
                   ├── bootcheck: announce healthy once the cluster took it, if asked
                   ├── debug: NodeDebug for the owner (the supervision tree)
                   ├── metrics: Prometheus /metrics, if asked (:mod:`.metrics`)
                   └── snapshots: etcd snapshots on a schedule, if asked (:mod:`.snapshots`)

:class:`RoleServer` publishes what :func:`~.disk.load` found (a finished
node: credentials, directory, roles; or a bootstrap intent) and runs the
worker on it. Roles are written to disk whenever they change, so a
single-node cluster restarts from its disk alone.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from metropolis.event import Value
from metropolis.localstorage import Root
from metropolis.proto.common import NodeRoles
from metropolis.roleserve import disk
from metropolis.roleserve.bootcheck import HealthAnnounce
from metropolis.roleserve.bootinfo import RunningImageSource
from metropolis.roleserve.controlplane import ControlPlaneWorker
from metropolis.roleserve.debugservice import DebugService
from metropolis.roleserve.directory import DirectoryUpdate
from metropolis.roleserve.rolefetch import RoleFetch
from metropolis.roleserve.snapshots import SnapshotSchedule
from metropolis.roleserve.statuspush import StatusPush
from metropolis.roleserve.values import BootstrapData, ClusterMembership

if TYPE_CHECKING:
    # Given only with --metrics-listen: a node without does not import
    # prometheus_client and the metrics server.
    from metropolis.roleserve.metrics import NodeMetrics
from metropolis.supervisor import Node

__all__ = ["RoleServer"]


class RoleServer:
    """The role server of one node; ``run`` is a supervisor runnable.

    Its values are public for observers and (in tests, and later the
    curator's role fetch) for feeding roles in.
    """

    def __init__(
        self,
        root: Root,
        saved: disk.SavedNode,
        *,
        fetch_roles: bool = True,
        metrics: NodeMetrics | None = None,
        snapshots: tuple[Path, float, int] | None = None,
        running: RunningImageSource | None = None,
        announce_healthy: Path | None = None,
    ) -> None:
        """``fetch_roles``: watch roles at the curators (off: the caller sets them).

        ``running``: what the node runs (:mod:`.bootinfo`; default: its image
        file, no boot info). ``announce_healthy``: the file the boot
        assessment writes once the node is healthy (:mod:`.bootcheck`).

        ``metrics``: count and serve the node's metrics there.
        ``snapshots``: (folder, interval in seconds, how many to keep) of
        the scheduled etcd snapshots (:mod:`.snapshots`), or None for none.
        """
        self.root = root
        self.metrics = metrics
        self._fetch_roles = fetch_roles
        self.settings = saved.settings
        self.bootstrap: Value[BootstrapData] = Value()
        self.membership: Value[ClusterMembership] = Value()
        self.roles: Value[NodeRoles] = Value()
        if saved.credentials is not None:
            self.membership.set(
                ClusterMembership(saved.credentials.public_key, saved.credentials, saved.directory)
            )
        elif saved.bootstrap is not None:
            self.membership.set(ClusterMembership(saved.bootstrap.node_public_key))
            self.bootstrap.set(saved.bootstrap)
        else:  # load() never returns this
            raise disk.NodeRootError("saved node has neither credentials nor a bootstrap intent")
        if saved.roles is not None:
            self.roles.set(saved.roles)
        self.worker = ControlPlaneWorker(
            root=root,
            settings=self.settings,
            bootstrap=self.bootstrap.readonly(),
            membership=self.membership,
            roles=self.roles,
            rpc_metrics=metrics.rpc if metrics is not None else None,
        )
        self.push = StatusPush(
            self.settings, self.membership.readonly(), self.worker.startup, running
        )
        self.announce: HealthAnnounce | None = None
        if announce_healthy is not None:
            self.announce = HealthAnnounce(
                announce_healthy, self.push.accepted.readonly(), self.roles.readonly()
            )
        self.snapshots: SnapshotSchedule | None = None
        if snapshots is not None:
            folder, interval, keep = snapshots
            self.snapshots = SnapshotSchedule(
                self.membership.readonly(), folder, interval=interval, keep=keep
            )
        if metrics is not None:
            metrics.attach(self.worker, self.push, self.membership.readonly(), self.snapshots)

    async def run(self, node: Node) -> None:
        node.run("controlplane", self.worker.run)
        node.run("persist-roles", self._persist_roles)
        if self._fetch_roles:
            fetch = RoleFetch(
                self.root,
                self.settings,
                self.membership.readonly(),
                self.roles,
                self.worker.startup,
            )
            node.run("rolefetch", fetch.run)
            directory = DirectoryUpdate(
                self.root, self.settings, self.membership, self.worker.startup
            )
            node.run("directory", directory.run)
        node.run("statuspush", self.push.run)
        if self.announce is not None:
            node.run("bootcheck", self.announce.run)
        rpc = self.metrics.rpc if self.metrics is not None else None
        node.run("debug", DebugService(self.settings, self.membership.readonly(), rpc).run)
        if self.metrics is not None:
            node.run("metrics", self.metrics.run)
        if self.snapshots is not None:
            node.run("snapshots", self.snapshots.run)
        node.signal_healthy()
        await trio.sleep_forever()

    async def _persist_roles(self, node: Node) -> None:
        # Roles from the curators are already on disk when published (role
        # fetch saves them first; save_roles skips unchanged content): this
        # saves roles set by anybody else, e.g. a caller with fetch_roles off.
        node.signal_healthy()
        with self.roles.watch() as watcher:
            while True:
                roles = await watcher.get()
                await trio.to_thread.run_sync(functools.partial(disk.save_roles, self.root, roles))
