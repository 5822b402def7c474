"""Revoking ConsensusMember from the node whose curator leads, and Watch's current peers.

Three real nodes (each its own OS process, real etcd) on 127.0.0.1/2/3, as
in :mod:`tests.metropolis.test_cluster`. The bootstrap node n1 leads; the
owner revokes its ConsensusMember role: n1 resigns, another curator leads
and removes n1's member, n1's etcd stops and its data is wiped, and n1 goes
on fetching its roles through the other curators (its cluster directory,
which named only itself, updated itself). Granting the role again joins it
as a new member. With only two members the same works: n1's etcd votes
until its member is removed, so the survivor never lacks a quorum.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from metropolis import pki
from metropolis.consensus.localetcd import etcd_pid
from metropolis.localstorage import Root
from metropolis.owner import Owner
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles
from metropolis.roleserve import disk
from metropolis.rpc import Endpoint, RPCError, Status, client_context, methods, open_client
from tests.metropolis.test_cluster import (
    ADDRESSES,
    BOUND,
    _curators,
    _form,
    _members,
    _owner_of_all,
    _rows,
    _until,
    _voters,
    three_nodes,
)
from tests.metropolis.test_node_cli import LEADS, NodeProcess


async def _retried(call: Callable[[], Awaitable[object]]) -> None:
    """``call`` until it succeeds; UNAVAILABLE (a curator going away) is retried."""

    async def once() -> bool:
        try:
            await call()
        except RPCError as e:
            assert e.code is Status.UNAVAILABLE, e
            return False
        return True

    await _until(once)


def _saved_roles(root: Root) -> NodeRoles:
    return disk.read_roles(root)


async def _revoke_and_grant_the_leading_n1(
    procs: list[NodeProcess], roots: list[Root], owner: Owner, voters: int
) -> None:
    """Revoke n1's ConsensusMember while it leads (``voters`` members), then grant it again.

    n2 is a voter throughout; n1's CRL and member checks read n2's etcd.
    """
    rows = await _rows(owner)
    n1 = rows[ADDRESSES[0]]
    assert procs[0].logged(LEADS)
    curators = sum(r.curator for r in rows.values())

    # n1 saved a directory naming only itself; it learns the others.
    async def n1_knows_all_curators() -> bool:
        return len(roots[0].esp.read_cluster_directory().nodes) == curators

    await _until(n1_knows_all_curators)
    [old_member] = [m for m in await _members(roots[0]) if m.name == n1.node_id]
    peer_certificate = roots[0].data.etcd.peer_pki.certificate.read_bytes()
    serial = pki.decode_certificate(peer_certificate).serial_number

    # The leader's own node: accepted now (it used to be refused).
    await _retried(lambda: owner.set_roles(n1.node_id, consensus_member=False))
    await procs[0].wait_for("resigning")

    async def another_leads() -> bool:
        return sum(p.logged(LEADS) for p in procs[1:]) == 1

    await _until(another_leads)
    await _voters(roots[1], voters - 1)
    assert all(m.name != n1.node_id for m in await _members(roots[1]))

    async def n1_without_etcd() -> bool:
        return etcd_pid(roots[0].ephemeral.consensus) is None

    await _until(n1_without_etcd)

    async def n1_wiped() -> bool:
        # Wiped, then the empty layout made again (not just gone).
        etcd = roots[0].data.etcd
        return not (etcd.data / "member").exists() and etcd.peer_pki.path.is_dir()

    await procs[0].wait_for("wiping etcd data")
    await _until(n1_wiped)

    async def revoked_on_crl() -> bool:
        crl = pki.decode_crl(roots[1].data.etcd.peer_crl.read_bytes())
        return crl.get_revoked_certificate_by_serial_number(serial) is not None

    await _until(revoked_on_crl)

    # n1 stays home: UP, without the role, and its role fetch (now through
    # the others) delivers a change made after its curator stopped.
    async def n1_row_without_consensus() -> bool:
        row = (await _rows(owner))[ADDRESSES[0]]
        return row.state == "UP" and "ConsensusMember" not in row.roles

    await _until(n1_row_without_consensus)
    # The bootstrap node has KubernetesController from the start.
    assert _saved_roles(roots[0]).kubernetes_controller is not None
    seen = len(procs[0].lines)
    await _retried(lambda: owner.set_roles(n1.node_id, kubernetes_controller=False))

    async def fetched_without_any_role() -> bool:
        return any("roles from the curator: none" in line for line in procs[0].lines[seen:])

    await _until(fetched_without_any_role)

    async def saved_roles_follow() -> bool:
        roles = _saved_roles(roots[0])
        return roles.consensus_member is None and roles.kubernetes_controller is None

    await _until(saved_roles_follow)

    # Grant again: a new member from wiped data, voting, curator up.
    await _retried(lambda: owner.set_roles(n1.node_id, consensus_member=True))
    await _voters(roots[1], voters)
    [new_member] = [m for m in await _members(roots[1]) if m.name == n1.node_id]
    assert new_member.id != old_member.id
    await _until(lambda: _curators(owner, curators))
    # One leader: the marked node never campaigned successfully again.
    assert sum(LEADS in line for line in procs[0].lines) == 1
    assert sum(p.logged(LEADS) for p in procs[1:]) == 1


def _assert_no_errors(procs: list[NodeProcess]) -> None:
    """Losing a curator and n1's etcd leaving after its member's removal are
    expected: they are logged as WARNINGs, never as ERRORs."""
    errors = [line for proc in procs for line in proc.lines if " ERROR " in line]
    assert not errors, errors


async def test_revoke_consensus_from_the_leading_bootstrap_node(tmp_path: Path) -> None:
    with trio.fail_after(2 * BOUND):
        async with (
            three_nodes(tmp_path) as (procs, roots, owner_key),
            _owner_of_all(roots, owner_key) as owner,
        ):
            await _form(owner, roots[0])
            await _until(lambda: _curators(owner, 3))
            await _revoke_and_grant_the_leading_n1(procs, roots, owner, voters=3)

        for proc in procs:
            assert proc.process.returncode == 0
        for root in roots:
            assert etcd_pid(root.ephemeral.consensus) is None
        _assert_no_errors(procs)


async def test_revoke_the_leader_of_two_members_keeps_quorum(tmp_path: Path) -> None:
    """With two members, n1's etcd must vote until its removal: n2 alone has no quorum.

    With etcd's member health wait, as a real cluster runs: its refusals
    (until every voter has been connected for 5 s) are retried.
    """
    with trio.fail_after(2 * BOUND):
        async with (
            three_nodes(tmp_path, health_wait=True) as (procs, roots, owner_key),
            _owner_of_all(roots, owner_key) as owner,
        ):

            async def registered() -> bool:
                return sum(r.state == "NEW" for r in await owner.nodes()) == 2

            await _until(registered)
            for row in await owner.nodes():
                if row.state == "NEW":
                    await owner.approve(row.node_id)

            async def n2_up() -> bool:
                row = (await _rows(owner)).get(ADDRESSES[1])
                return row is not None and row.state == "UP"

            await _until(n2_up)
            n2 = (await _rows(owner))[ADDRESSES[1]]
            await owner.set_roles(n2.node_id, consensus_member=True)
            await _voters(roots[0], 2)
            await _until(lambda: _curators(owner, 2))
            await _revoke_and_grant_the_leading_n1(procs, roots, owner, voters=2)
            assert procs[0].logged("--strict-reconfig-check=true")

        for proc in procs:
            assert proc.process.returncode == 0
        for root in roots:
            assert etcd_pid(root.ephemeral.consensus) is None
        _assert_no_errors(procs)


async def test_watch_sends_the_current_peers(tmp_path: Path) -> None:
    """n2 was granted when n1 was the only member; its Watch now names n1 and n3."""
    with trio.fail_after(BOUND):
        async with (
            three_nodes(tmp_path) as (_, roots, owner_key),
            _owner_of_all(roots, owner_key) as owner,
        ):
            _, n2, _ = await _form(owner, roots[0])
            saved = disk.load(roots[1])
            credentials = saved.credentials
            assert credentials is not None and credentials.node_id == n2.node_id
            endpoints = [Endpoint(a, saved.settings.curator_port) for a in ADDRESSES]
            context = client_context(
                credentials.ca_certificate, credentials.certificate, credentials.private_key
            )
            request = c.WatchRequest(
                node_in_cluster=c.WatchRequestNodeInCluster(node_id=n2.node_id)
            )
            expected = {
                (m.name, m.peer_urls[0]) for m in await _members(roots[0]) if m.name != n2.node_id
            }
            assert len(expected) == 2
            async with (
                open_client(endpoints, context) as client,
                client.stream(methods.WATCH, request) as call,
            ):
                async for event in call:
                    [record] = event.nodes
                    assert record.roles is not None
                    role = record.roles.consensus_member
                    assert role is not None
                    assert {(p.name, p.url) for p in role.peers} == expected
                    break
