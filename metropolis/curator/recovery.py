"""The record of one recovery of the cluster from a snapshot (:class:`Recovery`).

Written by ``node recover`` into the node's mark (:mod:`metropolis.roleserve.recoverpending`)
and by the curator into etcd (:mod:`.rejoin`); shown by ``owner recoveries``.
Standard library only, so that ``node recover`` writes it before the node's
wire is imported.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass

__all__ = ["Recovery"]


@dataclass(frozen=True)
class Recovery:
    """One recovery of the cluster from a snapshot."""

    #: The node that was recovered (the restored cluster's first member).
    node_id: str
    #: UTC, ISO 8601, and Unix time (ns), when the restored etcd was prepared.
    at: str
    at_ns: int
    #: The snapshot's etcd revision, when and on which node it was taken, its SHA-256.
    snapshot_revision: int
    snapshot_taken_at: str
    snapshot_node_id: str
    snapshot_sha256: str
    #: Nodes that held ConsensusMember: their members were dropped, they rejoin.
    rejoining: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Recovery:
        try:
            data = json.loads(raw)
            fields = {name: data[name] for name in cls.__dataclass_fields__}
            fields["rejoining"] = tuple(fields["rejoining"])
            return cls(**fields)
        except (ValueError, TypeError, KeyError) as e:
            # Imported here: the record needs neither etcd's client nor the
            # curator's state (``node recover`` writes one before either is
            # imported).
            from metropolis.curator.state import CuratorError

            raise CuratorError(f"damaged recovery record ({e})") from None

    @classmethod
    def now(
        cls,
        node_id: str,
        *,
        revision: int,
        taken_at: str,
        snapshot_node_id: str,
        sha256: str,
    ) -> Recovery:
        """A record of a recovery by ``node_id`` happening now (``rejoining`` still empty)."""
        # Unix ns, as the heartbeats the rejoins compare it with.
        at_ns = time.time_ns()
        at = datetime.datetime.fromtimestamp(at_ns / 1e9, datetime.UTC)
        return cls(
            node_id=node_id,
            at=at.isoformat(timespec="seconds"),
            at_ns=at_ns,
            snapshot_revision=revision,
            snapshot_taken_at=taken_at,
            snapshot_node_id=snapshot_node_id,
            snapshot_sha256=sha256,
            rejoining=(),
        )
