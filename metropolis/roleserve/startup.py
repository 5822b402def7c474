"""What the control plane should be, as a pure function of the role server's inputs.

The reducer folds tagged messages (the newest bootstrap data, home
membership, or roles) into a :class:`ReduceState` and derives a
:class:`ControlPlaneStartup`, a tagged union::

    roles known, membership home ─┬─ no ConsensusMember ─> NoControlPlane
                                  ├─ join data fits ─────> JoinControlPlane(join, credentials)
                                  └─ join data bad ──────> (no decision; logged, skipped)
    else bootstrap data known ───────────────────────────> BootstrapControlPlane(data)
    else ────────────────────────────────────────────────> (no decision yet)

Roles from the cluster win over bootstrap data that lingers (a TODO in
Monogon's seed): the bootstrap node whose ConsensusMember role is taken
away stops its control plane. A startup is bootstrap *or* join, never a
mix, and a join always carries the credentials it needs, so the seed's
"neither bootstrapping nor having credentials" panics cannot happen.

A decision holds the values the launcher acts on and nothing else: a new
directory, or the local services the launcher itself publishes in the
membership, make no new decision (membership counts only for whether the
node is home and with which credentials).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from metropolis.consensus.join import JoinCluster
from metropolis.errors import ConsensusError
from metropolis.identity import NodeCredentials
from metropolis.proto.common import NodeRoles
from metropolis.roleserve.values import BootstrapData, ClusterMembership

__all__ = [
    "BootstrapControlPlane",
    "BootstrapMessage",
    "ControlPlaneStartup",
    "Decision",
    "JoinControlPlane",
    "MembershipMessage",
    "Message",
    "NoControlPlane",
    "ReduceState",
    "RolesMessage",
    "changed",
    "has_control_plane",
    "reduce",
]


@dataclass(frozen=True)
class BootstrapMessage:
    data: BootstrapData


@dataclass(frozen=True)
class MembershipMessage:
    membership: ClusterMembership


@dataclass(frozen=True)
class RolesMessage:
    roles: NodeRoles


Message = BootstrapMessage | MembershipMessage | RolesMessage


@dataclass(frozen=True)
class NoControlPlane:
    """This node runs no consensus and no curator."""


@dataclass(frozen=True)
class BootstrapControlPlane:
    """Create a new cluster with this node as its first member."""

    data: BootstrapData


@dataclass(frozen=True)
class JoinControlPlane:
    """Run (or rejoin) consensus with the ConsensusMember role's join data."""

    join: JoinCluster
    #: The node's cluster credentials (of its home membership).
    credentials: NodeCredentials


ControlPlaneStartup = NoControlPlane | BootstrapControlPlane | JoinControlPlane


@dataclass(frozen=True)
class ReduceState:
    """The newest input of each kind seen so far (None: none yet)."""

    bootstrap: BootstrapData | None = None
    membership: ClusterMembership | None = None
    roles: NodeRoles | None = None


@dataclass(frozen=True)
class Decision:
    state: ReduceState
    #: None: nothing to decide (yet), or the roles' join data was bad.
    startup: ControlPlaneStartup | None
    #: Why the roles were skipped, to be logged; None if they were not.
    problem: str | None = None


def reduce(state: ReduceState, message: Message) -> Decision:
    """Fold ``message`` into ``state``; see the module docstring. Pure, never raises.

    Membership that is not home does not count (the mapper only sends home
    membership; this keeps the rule local).
    """
    if isinstance(message, BootstrapMessage):
        state = replace(state, bootstrap=message.data)
    elif isinstance(message, MembershipMessage):
        if message.membership.home:
            state = replace(state, membership=message.membership)
    else:
        state = replace(state, roles=message.roles)

    membership = state.membership
    if state.roles is not None and membership is not None and membership.credentials is not None:
        role = state.roles.consensus_member
        if role is None:
            return Decision(state, NoControlPlane())
        try:
            join = JoinCluster.from_proto(role)
            join.check(membership.credentials.private_key)
        except ConsensusError as e:
            return Decision(state, None, f"ConsensusMember role skipped: {e}")
        return Decision(state, JoinControlPlane(join, membership.credentials))
    if state.bootstrap is not None:
        return Decision(state, BootstrapControlPlane(state.bootstrap))
    return Decision(state, None)


def has_control_plane(startup: ControlPlaneStartup) -> bool:
    return not isinstance(startup, NoControlPlane)


def changed(old: ControlPlaneStartup, new: ControlPlaneStartup) -> bool:
    """Whether the launcher must restart: the control plane appears or disappears,
    or the join data gives this node a new peer certificate.

    A new peer certificate means the node was added to etcd again as a new
    member (after a recovery from a snapshot dropped its old one:
    :mod:`metropolis.curator.rejoin`); its etcd must start anew with that
    join data (the consensus service then drops the old member's data).
    Other differences (other peers in the join data, churned membership,
    bootstrap giving way to the roles it produced) do not restart a running
    etcd: its data directory already holds what the join data would seed
    it with.
    """
    if isinstance(old, JoinControlPlane) and isinstance(new, JoinControlPlane):
        return old.join.node_certificate != new.join.node_certificate
    return has_control_plane(old) != has_control_plane(new)
