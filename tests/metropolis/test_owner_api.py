"""Escrow, DeleteNode and GetNodes' etcd membership over real mutual TLS, real etcd.

One bootstrapped node whose curator leads (:func:`tests.metropolis.test_curator_api.cluster`),
other nodes registered and committed in-process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import metropolis.cli.owner as owner_cli
from metropolis import identity, pki
from metropolis.curator.state import CRL_KEY, join_key_key, read_node
from metropolis.owner import Change, NodeRow, _sort_key, describe_change, escrow_certificate
from metropolis.proto import aaa
from metropolis.proto import curator_api as c
from metropolis.proto import management as m
from metropolis.proto.common import NodeStatus
from metropolis.rpc import Client, RPCError, Status, client_context, methods, open_client
from tests.metropolis.test_curator_api import BOUND, Cluster, _joined, cluster


async def _escrow(
    cl: Cluster, proven: Ed25519PrivateKey | None, params: aaa.EscrowFromClientParameters
) -> bytes:
    async with (
        open_client([cl.endpoint], client_context(cl.ca), proof_key=proven) as client,
        client.bidi(methods.ESCROW) as call,
    ):
        await call.send(aaa.EscrowFromClient(parameters=params))
        await call.done_sending()
        return b"".join([a.emitted_certificate async for a in call])


def _params(key: bytes, name: str = "owner") -> aaa.EscrowFromClientParameters:
    return aaa.EscrowFromClientParameters(requested_identity_name=name, public_key=key)


async def test_escrow_gives_the_owner_key_a_certificate_and_nobody_else(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        owner = pki.public_key_bytes(cl.owner_key)
        certificate = await escrow_certificate([cl.endpoint], cl.ca, cl.owner_key)
        pki.verify_signed_by(certificate, cl.ca)
        async with open_client(
            [cl.endpoint], client_context(cl.ca, certificate, cl.owner_key)
        ) as client:
            info = await client.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
            assert pki.decode_certificate(info.ca_certificate) == cl.ca

        other = pki.generate_key()
        refusals = [
            (other, _params(pki.public_key_bytes(other)), Status.PERMISSION_DENIED),
            (cl.owner_key, _params(owner, "janedoe"), Status.UNIMPLEMENTED),
            (cl.owner_key, _params(pki.public_key_bytes(other)), Status.UNIMPLEMENTED),
            (cl.owner_key, _params(b"short"), Status.INVALID_ARGUMENT),
            (None, _params(owner), Status.UNAUTHENTICATED),
        ]
        for key, params, code in refusals:
            with pytest.raises(RPCError) as refused:
                await _escrow(cl, key, params)
            assert refused.value.code is code, (params, refused.value)
        with pytest.raises(RPCError) as not_owner:
            await escrow_certificate([cl.endpoint], cl.ca, other)
        assert not_owner.value.code is Status.PERMISSION_DENIED


async def _delete(owner: Client, node_id: str, *, force: bool = False) -> None:
    bypass = m.DeleteNodeRequestSafetyBypassHasRoles() if force else None
    await owner.unary(
        methods.DELETE_NODE, m.DeleteNodeRequest(id=node_id, safety_bypass_has_roles=bypass)
    )


async def _revision(cl: Cluster) -> int:
    return (await cl.kv.range(b"/", prefix=True)).revision


async def test_delete_refuses_live_nodes_with_roles_and_revokes_the_deleted(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, heartbeat_timeout=3.0) as cl, cl.owner() as owner:
        plain = await _joined(cl, owner, "127.0.0.2")
        busy = await _joined(cl, owner, "127.0.0.3")
        await owner.unary(
            methods.UPDATE_NODE_ROLES,
            m.UpdateNodeRolesRequest(id=busy.node_id, kubernetes_controller=True),
        )
        nodes = {identity.node_id(n.pubkey): n for n in await _nodes(owner)}
        assert nodes[cl.node.node_id].etcd_membership == m.NodeEtcdMembership.VOTER
        assert nodes[plain.node_id].etcd_membership == m.NodeEtcdMembership.NONE

        # Refused, and nothing written: roles, a live node forced, the
        # curator's own node, an unknown node. A heartbeat just before:
        # ``busy`` is live for the next 3 s.
        async with open_client([cl.endpoint], cl.node_context(busy)) as as_busy:
            await as_busy.unary(
                methods.UPDATE_NODE_STATUS,
                c.UpdateNodeStatusRequest(
                    node_id=busy.node_id, status=NodeStatus(external_address="127.0.0.3")
                ),
            )
        before = await _revision(cl)
        for node_id, force, code, text in [
            (busy.node_id, False, Status.FAILED_PRECONDITION, "holds roles (KubernetesController)"),
            (busy.node_id, True, Status.FAILED_PRECONDITION, "has not timed out"),
            (cl.node.node_id, True, Status.FAILED_PRECONDITION, "holds roles"),
            ("metropolis-0000", False, Status.NOT_FOUND, "no node"),
            ("metropolis-0/../x", False, Status.INVALID_ARGUMENT, "not a node ID"),
        ]:
            with pytest.raises(RPCError) as refused:
                await _delete(owner, node_id, force=force)
            assert refused.value.code is code and text in refused.value.message, refused.value
        assert await _revision(cl) == before

        # A node without roles goes at once: record, join key, certificate.
        join_key = (await read_node(cl.kv, plain.node_id)).join_key  # type: ignore[union-attr]
        await _delete(owner, plain.node_id)
        assert await read_node(cl.kv, plain.node_id) is None
        assert await cl.kv.get(join_key_key(join_key)) is None
        stored = await cl.kv.get(CRL_KEY)
        assert stored is not None
        crl = pki.decode_crl(stored.value)
        pki.verify_crl(crl, cl.ca)
        assert pki.is_revoked(crl, plain.certificate)
        # Refused from the answer on (no wait for the CRL watch).
        async with open_client([cl.endpoint], cl.node_context(plain)) as as_plain:
            with pytest.raises(RPCError) as revoked:
                await as_plain.unary(
                    methods.UPDATE_NODE_STATUS,
                    c.UpdateNodeStatusRequest(
                        node_id=plain.node_id, status=NodeStatus(external_address="127.0.0.2")
                    ),
                )
            assert revoked.value.code is Status.UNAUTHENTICATED
            assert "revoked" in revoked.value.message

        # The node with a role, once its heartbeat timed out: forced.
        with trio.fail_after(BOUND):
            while True:
                health = {identity.node_id(n.pubkey): n.health for n in await _nodes(owner)}
                if health[busy.node_id] == m.NodeHealth.HEARTBEAT_TIMEOUT:
                    break
                await trio.sleep(0.2)
        with pytest.raises(RPCError) as unforced:
            await _delete(owner, busy.node_id)
        assert unforced.value.code is Status.FAILED_PRECONDITION
        await _delete(owner, busy.node_id, force=True)
        assert await read_node(cl.kv, busy.node_id) is None
        stored = await cl.kv.get(CRL_KEY)
        assert stored is not None
        crl = pki.decode_crl(stored.value)
        # The list grows: both deleted nodes stay revoked.
        assert pki.is_revoked(crl, busy.certificate) and pki.is_revoked(crl, plain.certificate)
        assert [identity.node_id(n.pubkey) for n in await _nodes(owner)] == [cl.node.node_id]


async def test_get_nodes_tells_a_learner(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl, cl.owner() as owner:
        joined = await _joined(cl, owner, "127.0.0.2")
        await owner.unary(
            methods.UPDATE_NODE_ROLES,
            m.UpdateNodeRolesRequest(id=joined.node_id, consensus_member=True),
        )
        nodes = {identity.node_id(n.pubkey): n for n in await _nodes(owner)}
        # Added, never started: a learner, found by its peer URL.
        assert nodes[joined.node_id].etcd_membership == m.NodeEtcdMembership.LEARNER


async def _nodes(client: Client) -> list[m.Node]:
    async with client.stream(methods.GET_NODES, m.GetNodesRequest()) as call:
        return [n async for n in call]


def _row(**changes: object) -> NodeRow:
    base: dict[str, object] = {
        "node_id": "metropolis-abc",
        "public_key": b"k" * 32,
        "address": "127.0.0.2",
        "state": "UP",
        "roles": ("ConsensusMember",),
        "curator": True,
        "etcd": "voter",
    }
    return NodeRow(**{**base, **changes})  # type: ignore[arg-type]


def test_describe_change_says_what_changed_or_that_nothing_did() -> None:
    same = _row()
    assert describe_change(Change(same, same)) == (
        "metropolis-abc: nothing changed (roles ConsensusMember)"
    )
    revoked = _row(roles=(), etcd="none", curator=False)
    assert describe_change(Change(same, revoked)) == (
        "metropolis-abc: ConsensusMember revoked; etcd voter -> none (roles now none)"
    )
    assert describe_change(Change(same, same, ("ConsensusMember revoke",))) == (
        "metropolis-abc: ConsensusMember revoke accepted, not in effect yet (the curators "
        "complete it) (roles now ConsensusMember)"
    )
    new = _row(state="NEW", roles=(), etcd="none")
    assert describe_change(Change(new, _row(state="STANDBY", roles=(), etcd="none"))) == (
        "metropolis-abc: state NEW -> STANDBY (roles now none)"
    )
    assert describe_change(Change(same, None)) == (
        "deleted metropolis-abc (address 127.0.0.2); roles ConsensusMember gone with it; "
        "its etcd member (voter) removed; its certificate revoked: curators refuse it "
        "from now on"
    )


def test_curator_column_tells_a_dead_curator_and_rows_sort_by_address() -> None:
    assert _row(health="HEARTBEAT_TIMEOUT").curator_state == "down"
    assert _row(health="HEALTHY").curator_state == "yes"
    assert _row(curator=False).curator_state == "-"
    assert _row(leader=True).curator_state == "LEADER"
    rows = [
        _row(node_id="metropolis-c", address=""),
        _row(node_id="metropolis-b", address="127.0.0.10"),
        _row(node_id="metropolis-a", address="127.0.0.9"),
    ]
    ordered = sorted(rows, key=_sort_key)
    assert [r.address for r in ordered] == ["127.0.0.9", "127.0.0.10", ""]


async def test_a_slow_owner_call_says_what_it_waits_for(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner_cli, "_PATIENCE", 0.05)
    async with owner_cli.saying_waits("consensus-on"):
        await trio.sleep(0.3)
    said = capsys.readouterr().err
    assert "etcd admits a new member only once its leader is connected to every peer" in said
    async with owner_cli.saying_waits("consensus-on"):
        pass
    assert capsys.readouterr().err == ""
