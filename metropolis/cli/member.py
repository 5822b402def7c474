"""``owner snapshot`` and ``owner recoveries``: what the owner reads from the etcd
member on the node of ``--root`` (its client socket), not through a curator.

Imported by :mod:`metropolis.cli.owner` only for those two: the other
owner calls need no etcd client.
"""

from __future__ import annotations

from pathlib import Path

import trio

from metropolis.consensus.client import Client
from metropolis.consensus.config import CURATOR_NAMESPACE
from metropolis.consensus.settings import SOCKET_NAME
from metropolis.consensus.snapshot import cluster_identity, manifest_path, take_snapshot
from metropolis.curator.rejoin import read_recoveries
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.roleserve import disk

__all__ = ["recoveries", "snapshot"]


def _local_etcd(root: Root) -> Path:
    """The client socket of the etcd member on the node of ``root``; refused if none runs."""
    socket = root.ephemeral.consensus / SOCKET_NAME
    if not socket.exists():
        raise MetropolisError(
            f"no etcd member runs on the node of {root.path}: give the root of a node"
            " with ConsensusMember"
        )
    return socket


async def recoveries(root: Root) -> str:
    """The recoveries recorded in the cluster, one line each (oldest first)."""
    async with Client(_local_etcd(root)) as client:
        found = await read_recoveries(client.namespaced(CURATOR_NAMESPACE))
    if not found:
        return "no recovery from a snapshot"
    return "\n".join(
        f"{r.at} {r.node_id} recovered from snapshot revision {r.snapshot_revision}"
        f" (taken {r.snapshot_taken_at} on {r.snapshot_node_id}, sha256 {r.snapshot_sha256});"
        f" rejoining: {', '.join(r.rejoining) or 'none'}"
        for r in found
    )


async def snapshot(root: Root, out: Path) -> str:
    """Snapshot the etcd member of the node at ``root`` into ``out``; one line on it."""
    socket = _local_etcd(root)
    saved = await trio.to_thread.run_sync(disk.load, root)
    assert saved.credentials is not None  # the owner call above needs them
    made = await take_snapshot(
        socket,
        out,
        cluster_ca_sha256=cluster_identity(saved.credentials.ca_certificate),
        node_id=saved.credentials.node_id,
    )
    return (
        f"snapshot {out}: revision {made.revision}, {made.size} bytes, sha256 {made.sha256}"
        f" (manifest {manifest_path(out)})"
    )
