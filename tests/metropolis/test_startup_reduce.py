"""reduce() and changed(): properties over random message sequences (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from metropolis import pki
from metropolis.consensus import peerpki
from metropolis.consensus.join import ExistingNode, JoinCluster
from metropolis.curator.bootstrap import node_certificate
from metropolis.identity import NodeCredentials
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesKubernetesController,
)
from metropolis.roleserve.startup import (
    BootstrapControlPlane,
    BootstrapMessage,
    ControlPlaneStartup,
    JoinControlPlane,
    MembershipMessage,
    Message,
    NoControlPlane,
    ReduceState,
    RolesMessage,
    changed,
    reduce,
)
from metropolis.roleserve.values import BootstrapData, ClusterMembership

# One node, its cluster credentials, and join data for it (made once: keys are slow).
KEY = pki.generate_key()
PUBLIC = pki.public_key_bytes(KEY)
_ca_key = pki.generate_key()
_ca = pki.new_ca(_ca_key, "cluster")
CREDENTIALS = NodeCredentials(KEY, node_certificate(_ca_key, _ca, PUBLIC), _ca)
_peer_ca, _crl = peerpki.new_ca()
GOOD_JOINS = [
    JoinCluster(
        _peer_ca.certificate,
        peerpki.issue_local_certificate(_peer_ca, PUBLIC, ["127.0.0.1"]),
        _crl,
        tuple(ExistingNode(f"n{j}", f"https://10.0.0.{j}:7834") for j in range(i)),
    )
    for i in range(3)
]
_stranger = peerpki.issue_local_certificate(
    _peer_ca, pki.public_key_bytes(pki.generate_key()), ["127.0.0.1"]
)
BAD_ROLES = [
    NodeRolesConsensusMember(ca_certificate=b"junk", peer_certificate=b"", initial_crl=b""),
    # Parses, but the peer certificate is for another node's key.
    JoinCluster(_peer_ca.certificate, _stranger, _crl, ()).to_proto(),
]
BOOTSTRAPS = [
    BootstrapData(KEY, pki.generate_key(), b"c%d" % i, b"n%d" % i, PUBLIC) for i in range(2)
]
HOME = [
    ClusterMembership(PUBLIC, CREDENTIALS, ClusterDirectory()),
    ClusterMembership(PUBLIC, CREDENTIALS, ClusterDirectory(nodes=[])),
]
NOT_HOME = ClusterMembership(PUBLIC)


def _roles(kind: int, controller: bool) -> NodeRoles:
    roles = NodeRoles()
    if controller:
        roles.kubernetes_controller = NodeRolesKubernetesController()
    if kind < len(GOOD_JOINS):
        roles.consensus_member = GOOD_JOINS[kind].to_proto()
    elif kind < len(GOOD_JOINS) + len(BAD_ROLES):
        roles.consensus_member = BAD_ROLES[kind - len(GOOD_JOINS)]
    return roles  # else: no ConsensusMember


messages: st.SearchStrategy[Message] = st.one_of(
    st.sampled_from(BOOTSTRAPS).map(BootstrapMessage),
    st.sampled_from([*HOME, NOT_HOME]).map(MembershipMessage),
    st.builds(_roles, st.integers(0, len(GOOD_JOINS) + len(BAD_ROLES)), st.booleans()).map(
        RolesMessage
    ),
)


def _run(sequence: list[Message]) -> tuple[ReduceState, list[ControlPlaneStartup | None]]:
    state = ReduceState()
    out: list[ControlPlaneStartup | None] = []
    for message in sequence:
        decision = reduce(state, message)
        state = decision.state
        out.append(decision.startup)
        assert (decision.problem is not None) <= (decision.startup is None)
    return state, out


@settings(max_examples=300, deadline=None)
@given(sequence=st.lists(messages, max_size=12))
def test_reduce_follows_the_newest_inputs(sequence: list[Message]) -> None:
    state = ReduceState()
    seen_home = False
    last_roles: NodeRoles | None = None
    last_bootstrap: BootstrapData | None = None
    for message in sequence:
        decision = reduce(state, message)
        state = decision.state
        if isinstance(message, MembershipMessage) and message.membership.home:
            seen_home = True
        if isinstance(message, RolesMessage):
            last_roles = message.roles
        if isinstance(message, BootstrapMessage):
            last_bootstrap = message.data
        startup = decision.startup

        if seen_home and last_roles is not None:
            # Known roles win, over any lingering bootstrap data.
            role = last_roles.consensus_member
            if role is None:
                assert isinstance(startup, NoControlPlane)
            elif any(role == bad for bad in BAD_ROLES):
                assert startup is None and decision.problem is not None
            else:
                assert isinstance(startup, JoinControlPlane)
                assert startup.join.to_proto() == role
                assert startup.credentials is CREDENTIALS
        elif last_bootstrap is not None:
            assert startup == BootstrapControlPlane(last_bootstrap)
        else:
            assert startup is None
        # Never a mix: a join has no bootstrap data, a bootstrap no join data.
        assert isinstance(startup, NoControlPlane | BootstrapControlPlane | JoinControlPlane | None)


@settings(max_examples=200, deadline=None)
@given(sequence=st.lists(messages, max_size=12), data=st.data())
def test_reduce_depends_only_on_the_newest_of_each_kind(
    sequence: list[Message], data: st.DataObject
) -> None:
    """Shuffle all but the last message of each kind in front: same final state."""
    final, _ = _run(sequence)
    last: dict[type, Message] = {}
    for message in sequence:
        if not (isinstance(message, MembershipMessage) and not message.membership.home):
            last[type(message)] = message
    prefix = data.draw(st.permutations(sequence))
    tail = data.draw(st.permutations(list(last.values())))
    replayed, _ = _run([*prefix, *tail])
    assert replayed == final


def test_changed_when_the_control_plane_appears_or_disappears_or_the_member_is_new() -> None:
    bootstrap = BootstrapControlPlane(BOOTSTRAPS[0])
    join_a = JoinControlPlane(GOOD_JOINS[0], CREDENTIALS)
    # The same member, other peers: the join data a later fetch may bring.
    other_peers = replace(GOOD_JOINS[2], node_certificate=GOOD_JOINS[0].node_certificate)
    join_b = JoinControlPlane(other_peers, CREDENTIALS)
    none = NoControlPlane()
    assert not changed(bootstrap, join_a)
    assert not changed(join_a, join_b)
    assert not changed(none, NoControlPlane())
    assert changed(join_a, none) and changed(none, bootstrap)
    # Added again as a new member (after a recovery): a new peer certificate.
    rejoined = GOOD_JOINS[1]
    certificate = peerpki.issue_local_certificate(_peer_ca, PUBLIC, ["127.0.0.1"])
    join_c = JoinControlPlane(
        JoinCluster(rejoined.ca_certificate, certificate, rejoined.initial_crl, ()), CREDENTIALS
    )
    assert changed(join_a, join_c) and changed(join_c, join_b)
    assert changed(join_a, JoinControlPlane(GOOD_JOINS[2], CREDENTIALS))


def test_a_new_directory_makes_no_new_decision() -> None:
    """The decision holds what the launcher acts on: join data and credentials, not the
    directory, which the launcher and the directory update publish in the membership."""
    state = reduce(ReduceState(), RolesMessage(_roles(1, False))).state
    first = reduce(state, MembershipMessage(HOME[0]))
    other = ClusterDirectory(
        nodes=[ClusterDirectoryNode(PUBLIC, [ClusterDirectoryNodeAddress(host="10.0.0.9")])]
    )
    moved = ClusterMembership(PUBLIC, CREDENTIALS, other)
    second = reduce(first.state, MembershipMessage(moved))
    assert isinstance(first.startup, JoinControlPlane)
    assert second.startup == first.startup
    assert second.state.membership == moved  # the state still follows the newest input
