"""After a recovery, on a real one-member etcd: the restored etcd prepared, and the
leading curator's rejoins.

A marked node is added again as a new learner, with a new peer
certificate, only once it is heard from after the recovery; a mark whose
node has lost ConsensusMember goes without a member being added.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity, pki
from metropolis.consensus.client import KV, Client
from metropolis.consensus.config import CURATOR_NAMESPACE
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.localetcd import EtcdServer
from metropolis.consensus.peerpki import issue_local_certificate, new_ca
from metropolis.curator.rejoin import Recovery, prepare_restored, read_recoveries
from metropolis.curator.state import (
    CONSENSUS_REJOINS,
    LEADER_KEY,
    CuratorError,
    consensus_rejoin_key,
    consensus_removal_key,
    heartbeat_key,
    node_key,
    read_node,
)
from metropolis.proto.common import NodeRoles, NodeRolesKubernetesController, NodeState, NodeStatus
from metropolis.proto.curator import Node
from tests.metropolis.test_curator_api import cluster

BOUND = 60


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    # Polling: the curator acts in its own tasks, on its own schedule.
    while not await check():  # noqa: ASYNC110
        await trio.sleep(0.05)


async def _marks(kv: KV) -> set[str]:
    found = await kv.range(CONSENSUS_REJOINS, prefix=True)
    return {k.key.removeprefix(CONSENSUS_REJOINS).decode() for k in found.kvs}


def _dropped_member() -> tuple[Ed25519PrivateKey, JoinCluster, Node]:
    """A node at 127.0.0.9 whose etcd member a recovery dropped: key, old join data, record.

    The old join data comes from a peer CA of its own: it is not this cluster's.
    """
    key = pki.generate_key()
    public = pki.public_key_bytes(key)
    ca, crl = new_ca()
    old = JoinCluster(ca.certificate, issue_local_certificate(ca, public, ["127.0.0.9"]), crl, ())
    record = Node(
        public_key=public,
        fsm_state=NodeState.UP,
        roles=NodeRoles(consensus_member=old.to_proto()),
        status=NodeStatus(external_address="127.0.0.9"),
    )
    return key, old, record


async def _join_data(kv: KV, node_id: str) -> JoinCluster:
    stored = await read_node(kv, node_id)
    assert stored is not None and stored.roles is not None
    role = stored.roles.consensus_member
    assert role is not None
    return JoinCluster.from_proto(role)


async def test_a_marked_node_rejoins_once_heard_from_and_a_node_without_the_role_does_not(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND):
        async with cluster(tmp_path) as cl:
            key, old, member = _dropped_member()
            public = member.public_key
            other_key = pki.public_key_bytes(pki.generate_key())
            other = Node(
                public_key=other_key,
                fsm_state=NodeState.UP,
                roles=NodeRoles(kubernetes_controller=NodeRolesKubernetesController()),
                status=NodeStatus(external_address="127.0.0.8"),
            )
            member_id, other_id = identity.node_id(public), identity.node_id(other_key)
            recovered = str(time.time_ns()).encode()
            for node_id, record in ((member_id, member), (other_id, other)):
                await cl.kv.put(node_key(node_id), bytes(record))
                # Heard from before the recovery: not a sign of life since.
                await cl.kv.put(heartbeat_key(node_id), str(time.time_ns() - 10**9).encode())
            for node_id in (member_id, other_id):
                await cl.kv.put(consensus_rejoin_key(node_id), recovered)

            async def other_mark_gone() -> bool:
                return await _marks(cl.kv) == {member_id}

            await _until(other_mark_gone)
            # Not heard from since the recovery: no member added.
            assert len(await cl.status.members()) == 1

            await cl.kv.put(heartbeat_key(member_id), str(time.time_ns()).encode())

            async def added() -> bool:
                # The member first, then the record with its join data.
                return await _join_data(cl.kv, member_id) != old

            await _until(added)
            [learner] = [m for m in await cl.status.members() if m.is_learner]
            assert learner.peer_urls == ["https://127.0.0.9:7834"]
            join = await _join_data(cl.kv, member_id)
            join.check(key)  # for its key, from the cluster's peer CA
            assert join.node_certificate != old.node_certificate
            assert [n.name for n in join.existing_nodes] == [cl.node.node_id]
            # A learner that has not caught up keeps its mark.
            assert await _marks(cl.kv) == {member_id}


async def test_a_learner_added_without_its_record_written_gets_its_join_data(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND):
        async with cluster(tmp_path) as cl:
            _, old, record = _dropped_member()
            node_id = identity.node_id(record.public_key)
            await cl.kv.put(node_key(node_id), bytes(record))
            # What a pass leaves that lost its lead between the learner's
            # addition (with a new certificate) and the record's write.
            issuing = await cl.status.load_node_pki(node_id)
            made = await cl.status.add_node(
                record.public_key,
                peer_url="https://127.0.0.9:7834",
                node_pki=replace(issuing, stored_certificate=None),
            )
            await cl.kv.put(consensus_rejoin_key(node_id), str(time.time_ns()).encode())

            async def written() -> bool:
                return await _join_data(cl.kv, node_id) != old

            await _until(written)
            join = await _join_data(cl.kv, node_id)
            assert join.node_certificate == made.node_certificate
            assert len(await cl.status.members()) == 2  # no second learner


async def test_prepare_restored_marks_the_members_and_refuses_a_node_it_does_not_know(
    etcd: EtcdServer,
) -> None:
    async with Client(etcd.socket_path) as client:
        kv = client.namespaced(CURATOR_NAMESPACE)
        names = ("own", "a", "b", "leaving")
        keys = {name: pki.public_key_bytes(pki.generate_key()) for name in names}
        ids = {name: identity.node_id(key) for name, key in keys.items()}
        ca, crl = new_ca()
        old = JoinCluster(
            ca.certificate, issue_local_certificate(ca, keys["a"], ["127.0.0.9"]), crl, ()
        )
        roles = {
            "own": NodeRoles(kubernetes_controller=NodeRolesKubernetesController()),
            "a": NodeRoles(consensus_member=old.to_proto()),
            "b": NodeRoles(),
            "leaving": NodeRoles(consensus_member=old.to_proto()),
        }
        for name, key in keys.items():
            record = Node(public_key=key, fsm_state=NodeState.UP, roles=roles[name])
            await kv.put(node_key(ids[name]), bytes(record))
        await kv.put(LEADER_KEY, b"the old leader")
        await kv.put(consensus_removal_key(ids["own"]), keys["own"])
        await kv.put(consensus_removal_key(ids["leaving"]), keys["leaving"])

        def recovery(node_id: str) -> Recovery:
            return Recovery.now(
                node_id, revision=7, taken_at="then", snapshot_node_id=ids["a"], sha256="00"
            )

        role = JoinCluster(
            ca.certificate, issue_local_certificate(ca, keys["own"], ["127.0.0.1"]), crl, ()
        ).to_proto()
        stranger = identity.node_id(pki.public_key_bytes(pki.generate_key()))
        before = (await kv.range(b"/", prefix=True)).revision
        with pytest.raises(CuratorError, match="no record of this node"):
            await prepare_restored(kv, recovery(stranger), role)
        assert (await kv.range(b"/", prefix=True)).revision == before  # nothing written

        own_roles, done = await prepare_restored(kv, recovery(ids["own"]), role)
        assert own_roles.consensus_member == role
        assert own_roles.kubernetes_controller is not None
        assert done.rejoining == (ids["a"],)
        assert await _marks(kv) == {ids["a"]}
        assert await kv.get(LEADER_KEY) is None
        assert await kv.get(consensus_removal_key(ids["own"])) is None
        assert await kv.get(consensus_removal_key(ids["leaving"])) is not None
        stored = await read_node(kv, ids["own"])
        assert stored is not None and stored.roles == own_roles
        assert await read_recoveries(kv) == [done]
