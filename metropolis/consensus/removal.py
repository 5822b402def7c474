"""Telling etcd's own exit after its member was removed from a crash.

:class:`EtcdUntilRemoved` runs etcd for the consensus service and notes
whether it left because the cluster removed its member; the service then
waits for the role change instead of restarting it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from metropolis.consensus.client import EndpointStatus
from metropolis.consensus.process import EtcdExited, ProcessConfig, run_etcd

__all__ = ["REMOVAL_PANIC", "EtcdUntilRemoved"]


#: What etcd 3.4 panics with when a client request races the removal of its
#: own member (etcd-io/etcd#21966, #18606): it means "removed" as much as
#: its clean exit does.
REMOVAL_PANIC = "failed to find local ID in cluster members"


class EtcdUntilRemoved:
    """Runs etcd and notes whether it left on its own because its member was removed.

    etcd 3.4 stops by itself, with status 0, once it learns that its member
    was removed from the cluster (``member remove``, here the revocation of
    the node's ConsensusMember role). Every stop we ask for cancels
    :func:`run_etcd` instead (SIGTERM, and no :class:`EtcdExited`), so an
    ``EtcdExited(0)`` is etcd's own decision. So is one known crash: a
    client request that reaches etcd while it applies its own removal
    makes it panic (status 2, :data:`REMOVAL_PANIC`) instead of exiting
    cleanly; any request of this node (the promoter's, the curator's) can
    be the one. That panic counts as a removal only once etcd had been
    running: at start it would mean a damaged data directory. Any other
    crash (non-zero status, a signal) is raised, for the supervisor to
    restart etcd.
    """

    def __init__(self) -> None:
        self.exited = False
        #: Set by the caller once etcd answered (``nursery.start`` returned).
        self.ready = False

    async def run_etcd(
        self,
        process: ProcessConfig,
        logger: logging.Logger,
        scope: trio.CancelScope,
        server_started: trio.Event,
        on_promotion: Callable[[], None],
        on_peer_active: Callable[[], None],
        *,
        task_status: trio.TaskStatus[EndpointStatus] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """:func:`run_etcd`; when it leaves because it was removed, cancel ``scope`` and wait.

        Waiting (not returning) keeps ``nursery.start`` from failing when
        etcd leaves before it was ready: the cancellation ends both.
        """
        try:
            await run_etcd(
                process,
                logger,
                task_status=task_status,
                server_started=server_started,
                on_promotion=on_promotion,
                on_peer_active=on_peer_active,
            )
        except EtcdExited as e:
            panicked = e.returncode == 2 and REMOVAL_PANIC in e.fatal and self.ready
            if e.returncode != 0 and not panicked:
                raise
            if panicked:
                # Not "was removed": that is said once, when the service has stopped.
                logger.warning("etcd panicked during its member's removal (a known etcd race)")
        self.exited = True
        scope.cancel()
        await trio.sleep_forever()
