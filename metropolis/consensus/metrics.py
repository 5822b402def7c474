"""What the local etcd member says of itself, for the node's metrics.

Two calls on etcd's client socket (its own HTTP server, beside the gateway
the etcd client uses): ``/v3/maintenance/status`` for the raft term and
indexes (committed and applied: their difference is the apply lag), and
``/metrics`` for etcd's own counters, of which only a few are read:
whether the member has a leader, is the leader or a learner, and how many
leader changes it has seen since its process started (etcd counts them
itself, so a change between two scrapes is never missed).

Cancellation: cancelling :func:`read_member` closes its connections.
Errors: :class:`~metropolis.consensus.unixhttp.TransportError` when etcd
does not answer (not running, too slow), or answers something else than
expected (a :class:`~metropolis.errors.ConsensusError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from metropolis.consensus.unixhttp import TransportError, UnixHTTP

__all__ = ["MemberMetrics", "read_member"]

#: etcd's own samples read from its ``/metrics`` (they carry no labels).
_SAMPLES = (
    "etcd_server_has_leader",
    "etcd_server_is_leader",
    "etcd_server_is_learner",
    "etcd_server_leader_changes_seen_total",
    "etcd_server_proposals_pending",
)


@dataclass(frozen=True)
class MemberMetrics:
    """One reading of the local member."""

    has_leader: bool
    is_leader: bool
    is_learner: bool
    #: Leader changes this member has seen since its process started.
    leader_changes_seen: int
    raft_term: int
    #: Index of the last raft entry committed, and of the last one applied.
    raft_index: int
    raft_applied_index: int
    proposals_pending: int

    @property
    def apply_lag(self) -> int:
        """Committed entries this member has not applied yet."""
        return max(0, self.raft_index - self.raft_applied_index)


def parse_samples(text: str) -> dict[str, float]:
    """The unlabelled samples of :data:`_SAMPLES` in etcd's exposition ``text``."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _SAMPLES:
            try:
                found[name] = float(value)
            except ValueError:
                raise TransportError(f"etcd metric {name}: not a number: {value!r}") from None
    return found


async def read_member(socket_path: Path, *, call_timeout: float = 2.0) -> MemberMetrics:
    """Read the member behind ``socket_path``; each call bounded by ``call_timeout``."""
    http = UnixHTTP(socket_path, timeout=call_timeout, connect_timeout=call_timeout, host="etcd")
    try:
        code, body = await http.post("/v3/maintenance/status", b"{}")
        if code != 200:
            raise TransportError(f"etcd status: HTTP {code}")
        try:
            status = json.loads(body)
            term = int(status.get("raftTerm", 0))
            index = int(status.get("raftIndex", 0))
            applied = int(status.get("raftAppliedIndex", 0))
        except (ValueError, TypeError, AttributeError) as e:
            raise TransportError(f"etcd status: unexpected answer: {e}") from None
        code, body = await http.post("/metrics", b"")
        if code != 200:
            raise TransportError(f"etcd metrics: HTTP {code}")
        samples = parse_samples(body.decode("utf-8", "replace"))
    finally:
        http.close()
    missing = [name for name in _SAMPLES if name not in samples]
    if missing:
        raise TransportError(f"etcd metrics: missing {', '.join(missing)}")
    return MemberMetrics(
        has_leader=samples["etcd_server_has_leader"] == 1,
        is_leader=samples["etcd_server_is_leader"] == 1,
        is_learner=samples["etcd_server_is_learner"] == 1,
        leader_changes_seen=int(samples["etcd_server_leader_changes_seen_total"]),
        raft_term=term,
        raft_index=index,
        raft_applied_index=applied,
        proposals_pending=int(samples["etcd_server_proposals_pending"]),
    )
