"""The leading curator's rejoins after a recovery, on a real one-member etcd.

A marked node is added again as a new learner, with a new peer
certificate, only once it is heard from after the recovery; a mark whose
node has lost ConsensusMember goes without a member being added.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from metropolis import identity, pki
from metropolis.consensus.client import KV
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.peerpki import issue_local_certificate, new_ca
from metropolis.curator.state import (
    CONSENSUS_REJOINS,
    consensus_rejoin_key,
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


async def test_a_marked_node_rejoins_once_heard_from_and_a_node_without_the_role_does_not(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND):
        async with cluster(tmp_path) as cl:
            # The dropped member's join data, from a peer CA of its own.
            key = pki.generate_key()
            public = pki.public_key_bytes(key)
            ca, crl = new_ca()
            old = JoinCluster(
                ca.certificate, issue_local_certificate(ca, public, ["127.0.0.9"]), crl, ()
            )
            member = Node(
                public_key=public,
                fsm_state=NodeState.UP,
                roles=NodeRoles(consensus_member=old.to_proto()),
                status=NodeStatus(external_address="127.0.0.9"),
            )
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
                return len(await cl.status.members()) == 2

            await _until(added)
            [learner] = [m for m in await cl.status.members() if m.is_learner]
            assert learner.peer_urls == ["https://127.0.0.9:7834"]
            record = await read_node(cl.kv, member_id)
            assert record is not None and record.roles is not None
            role = record.roles.consensus_member
            assert role is not None
            join = JoinCluster.from_proto(role)
            join.check(key)  # for its key, from the cluster's peer CA
            assert join.node_certificate != old.node_certificate
            assert [n.name for n in join.existing_nodes] == [cl.node.node_id]
            # A learner that has not caught up keeps its mark.
            assert await _marks(cl.kv) == {member_id}
