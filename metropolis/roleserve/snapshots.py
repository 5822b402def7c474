"""Scheduled etcd snapshots on every control-plane node.

``node bootstrap|register|run --snapshot-interval SECONDS [--snapshot-keep N]
[--snapshot-dir DIR]`` (not saved: give them on every start): while this node
runs a consensus member, its member is snapshotted every interval
(:func:`~metropolis.consensus.snapshot.take_snapshot`) into DIR (default
``ROOT/data/snapshots``, outside ``data/etcd``, which a node that leaves
consensus wipes) as ``snapshot-<UTC time>.db`` with its manifest; the
newest N are kept (pruned after each snapshot, and when the runnable
starts: a stop in between leaves N + 1 until then). Every member holds the whole keyspace, so each
control-plane node keeps its own recent copies and one survivor is enough.

Cancellation: cancelled with the role server; a snapshot being written is
abandoned (its ``.tmp`` files removed). Errors: a snapshot that fails is
logged at WARNING and tried again at the next interval; the runnable does
not fail for it.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import trio

from metropolis.consensus import Service
from metropolis.consensus.snapshot import (
    SnapshotError,
    cluster_identity,
    manifest_path,
    take_snapshot,
)
from metropolis.event import ReadOnlyValue
from metropolis.roleserve.values import ClusterMembership
from metropolis.supervisor import Node

__all__ = ["SnapshotSchedule", "prune", "snapshot_name"]

PREFIX = "snapshot-"
SUFFIX = ".db"


def snapshot_name(at: datetime.datetime) -> str:
    """The file name of a snapshot taken at ``at`` (sorts by time)."""
    return f"{PREFIX}{at.astimezone(datetime.UTC):%Y%m%dT%H%M%S.%fZ}{SUFFIX}"


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` snapshots in ``folder`` (blocking); the deleted."""
    found = sorted(
        p for p in folder.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX)
    )
    gone = found[: max(0, len(found) - keep)]
    for path in gone:
        # The manifest first: a snapshot without it is never taken as valid.
        manifest_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    return gone


class SnapshotSchedule:
    """The snapshot runnable of one node; see the module docstring."""

    def __init__(
        self,
        membership: ReadOnlyValue[ClusterMembership],
        folder: Path,
        *,
        interval: float,
        keep: int,
    ) -> None:
        if interval <= 0 or keep < 1:
            raise ValueError("snapshot interval must be positive and keep at least 1")
        self._membership = membership
        self.folder = folder
        self._interval = interval
        self._keep = keep
        #: Snapshots by outcome (``ok``, ``failed``) since the node started.
        self.outcomes: dict[str, int] = {"ok": 0, "failed": 0}
        #: ``trio.current_time()`` of the last snapshot written.
        self.last_taken: float | None = None
        self._now: ClusterMembership | None = None
        self._changed = trio.Event()

    async def run(self, node: Node) -> None:
        await trio.to_thread.run_sync(_make_folder, self.folder)
        await trio.to_thread.run_sync(prune, self.folder, self._keep)
        node.signal_healthy()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow)
            while True:
                deadline = trio.current_time() + self._interval
                with trio.move_on_at(deadline):
                    membership = await self._with_consensus()
                    service = membership.local_consensus
                    credentials = membership.credentials
                    assert service is not None and credentials is not None
                    await service.wait_running()
                    await self._take(
                        node,
                        service,
                        cluster_identity(credentials.ca_certificate),
                        credentials.node_id,
                    )
                await trio.sleep_until(deadline)

    async def _follow(self) -> None:
        with self._membership.watch() as watcher:
            while True:
                self._now = await watcher.get()
                self._changed.set()
                self._changed = trio.Event()

    async def _with_consensus(self) -> ClusterMembership:
        """The newest membership once it has credentials and a local consensus member."""
        while True:
            now = self._now
            if now is not None and now.credentials is not None and now.local_consensus:
                return now
            await self._changed.wait()

    async def _take(self, node: Node, service: Service, ca: str, node_id: str) -> None:
        out = self.folder / snapshot_name(datetime.datetime.now(datetime.UTC))
        try:
            manifest = await take_snapshot(
                service.config.client_socket,
                out,
                cluster_ca_sha256=ca,
                node_id=node_id,
                limit=max(10.0, min(self._interval, 600.0)),
            )
        except (SnapshotError, OSError) as e:
            node.logger.warning("snapshot not taken: %s", e)
            self.outcomes["failed"] += 1
            return
        self.outcomes["ok"] += 1
        self.last_taken = trio.current_time()
        node.logger.info(
            "snapshot %s: revision %d, %d bytes", out.name, manifest.revision, manifest.size
        )
        for path in await trio.to_thread.run_sync(prune, self.folder, self._keep):
            node.logger.info("snapshot %s removed (keeping %d)", path.name, self._keep)


def _make_folder(folder: Path) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
