"""A rolling upgrade's order and gate, from the cluster's own view (pure functions).

Both read the node table as the owner sees it (`metropolis.owner.NodeRow`,
``GetNodes`` at the leading curator: the curator's health of each node, its
etcd membership as the cluster's etcd lists it, which curator leads), never
the agents' word::

    phase 0   nodes without a consensus role       up to --max-unavailable at once
    phase 1   consensus members (voters, learners)  one at a time
    phase 2   the leader's node (its curator leads)  last, alone

`gate` says whether one machine's node may go down now:

    WAIT    more nodes would be unavailable than --max-unavailable allows
            (unavailable: not UP and HEALTHY in the cluster's view, or being
            upgraded now), or, for a consensus member: another consensus
            member is not healthy, or its phase is not reached yet, or it
            leads while other members of the run are not done
    REFUSE  a consensus member whose etcd would lack a quorum with one voter
            fewer (fewer than three voters): waiting cannot help, the run stops
    GO      otherwise

`upgraded` and `went_back` say how a machine's upgrade ended, again from
the node's own status in the cluster: the new image, healthy, its slot
permanent (and a voter again, if it was one); or its machine's report that
it went back from the new image, and why.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the owner's client: not imported by a mere --help
    from metropolis.owner import NodeRow

__all__ = ["Verdict", "gate", "phase", "upgraded", "went_back"]

CONSENSUS_ROLE = "ConsensusMember"


def phase(row: NodeRow) -> int:
    """0 no consensus role, 1 a consensus member, 2 the leader's node."""
    if row.leader:
        return 2
    if CONSENSUS_ROLE in row.roles or row.etcd in ("voter", "learner"):
        return 1
    return 0


def available(row: NodeRow) -> bool:
    return row.state == "UP" and row.health == "HEALTHY"


class Verdict(enum.Enum):
    GO = "go"
    WAIT = "wait"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    why: str = ""


def gate(
    target: NodeRow,
    rows: Sequence[NodeRow],
    *,
    in_flight: Iterable[str],
    max_unavailable: int,
    earlier_not_done: int,
    consensus_not_done: int,
) -> Decision:
    """Whether ``target``'s node may go down for its upgrade now (see the module).

    ``in_flight``: node ids of the run's machines being upgraded now (other
    than the target); ``earlier_not_done``: machines of the run in a lower
    phase not done yet; ``consensus_not_done``: other machines of the run
    whose node holds a consensus role, not done yet (the leader goes last).
    """
    busy = set(in_flight) - {target.node_id}
    down = {r.node_id for r in rows if not available(r) and r.node_id != target.node_id} | busy
    if len(down) + 1 > max_unavailable:
        names = ", ".join(sorted(down))
        return Decision(
            Verdict.WAIT,
            f"{len(down)} other node(s) unavailable or being upgraded ({names}); "
            f"at most {max_unavailable} at a time",
        )
    p = phase(target)
    if p > 0 and earlier_not_done:
        return Decision(
            Verdict.WAIT, f"{earlier_not_done} machine(s) of an earlier phase are not done"
        )
    if p == 0:
        return Decision(Verdict.GO)
    members = [r for r in rows if CONSENSUS_ROLE in r.roles or r.etcd in ("voter", "learner")]
    sick = [r.node_id for r in members if r.node_id != target.node_id and not available(r)]
    if sick:
        return Decision(Verdict.WAIT, f"consensus member(s) {', '.join(sorted(sick))} not healthy")
    if busy:
        return Decision(Verdict.WAIT, "another machine is being upgraded (members go alone)")
    if target.etcd == "voter":
        voters = sum(r.etcd == "voter" for r in rows)
        quorum = voters // 2 + 1
        if voters - 1 < quorum:
            return Decision(
                Verdict.REFUSE,
                f"etcd has {voters} voter(s): without {target.node_id} it would lack a quorum "
                f"of {quorum}; a cluster needs three voters to be upgraded without stopping",
            )
    if p == 2 and consensus_not_done:
        return Decision(
            Verdict.WAIT,
            f"its curator leads: it goes after the {consensus_not_done} other member(s)",
        )
    return Decision(Verdict.GO)


def upgraded(row: NodeRow, digest: str, *, was_voter: bool) -> bool:
    """Whether ``row``'s node runs ``digest`` (``sha256:...``), healthy, on a
    permanent slot, and (if it was one) an etcd voter again."""
    return (
        row.image == digest
        and not row.trial
        and available(row)
        and (row.etcd == "voter" or not was_voter)
    )


def went_back(row: NodeRow, digest: str) -> str | None:
    """Why ``row``'s machine went back from ``digest``, once its node runs the
    old slot again and says so; None otherwise."""
    if row.rolled_back == digest and row.image != digest:
        return row.rollback_cause or "went back to the old slot (no cause given)"
    return None
