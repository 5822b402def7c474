"""The curator's RPC API over real mutual TLS, on a bootstrapped single node with real etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import KV, Lease
from metropolis.curator import nodeapi
from metropolis.curator.election import Leader
from metropolis.curator.server import CuratorServer
from metropolis.curator.service import Curator
from metropolis.curator.state import CA_KEY_KEY, CRL_KEY, CuratorError, node_key, read_node
from metropolis.proto import curator_api as c
from metropolis.proto import management as m
from metropolis.proto.common import NodeState, NodeStatus, NodeStatusRunningCurator
from metropolis.rpc import (
    Client,
    Endpoint,
    RPCError,
    Status,
    client_context,
    methods,
    open_client,
    sign_proof,
)
from metropolis.supervisor import open_supervisor
from tests.metropolis.test_curator import bootstrapped, consensus

BOUND = 60


@dataclass
class Cluster:
    status: ConsensusStatus
    kv: KV
    endpoint: Endpoint
    ca: x509.Certificate
    ca_key: Ed25519PrivateKey
    node: identity.NodeCredentials
    owner_key: Ed25519PrivateKey

    def owner_context(self) -> object:
        cert = pki.issue_certificate(
            self.ca_key, self.ca, self.owner_key.public_key(), "owner", pki.Usage.CLIENT
        )
        return client_context(self.ca, cert, self.owner_key)

    def node_context(self, credentials: identity.NodeCredentials) -> object:
        return client_context(self.ca, credentials.certificate, credentials.private_key)

    @asynccontextmanager
    async def owner(self) -> AsyncIterator[Client]:
        async with open_client([self.endpoint], self.owner_context()) as client:
            yield client


@asynccontextmanager
async def cluster(
    tmp_path: Path, *, learner_timeout: float = 60.0, heartbeat_timeout: float = 10.0
) -> AsyncIterator[Cluster]:
    """A bootstrapped node whose curator leads and serves the API on loopback."""
    async with consensus(tmp_path) as (service, _, status):
        owner_key = pki.generate_key()
        result, credentials = await bootstrapped(
            service, status, owner_public_key=pki.public_key_bytes(owner_key)
        )
        kv = status.curator_client()
        stored = await kv.get(CA_KEY_KEY)
        assert stored is not None
        curator = Curator(
            service.status,
            credentials.node_id,
            credentials=credentials,
            listen=("127.0.0.1", 0),
            learner_timeout=learner_timeout,
            heartbeat_timeout=heartbeat_timeout,
        )
        async with open_supervisor(curator.run, name="curator"):
            with trio.fail_after(BOUND):
                with curator.port.watch() as w:
                    port = await w.get()
                with curator.election.watch() as e:
                    await e.get(lambda s: isinstance(s, Leader))
            yield Cluster(
                status,
                kv,
                Endpoint("127.0.0.1", port, credentials.public_key),
                result.ca_certificate,
                pki.decode_private_key(stored.value),
                credentials,
                owner_key,
            )


async def _nodes(client: Client) -> list[m.Node]:
    async with client.stream(methods.GET_NODES, m.GetNodesRequest()) as call:
        return [n async for n in call]


async def test_owner_sees_the_cluster_and_a_node_is_refused_owner_calls(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        async with cl.owner() as owner:
            info = await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
            assert pki.decode_certificate(info.ca_certificate) == cl.ca
            nodes = await _nodes(owner)
            assert [n.pubkey for n in nodes] == [cl.node.public_key]
            assert nodes[0].state == NodeState.UP
            roles = nodes[0].roles
            assert roles is not None and roles.consensus_member is not None
        async with open_client([cl.endpoint], cl.node_context(cl.node)) as as_node:
            with pytest.raises(RPCError) as refused:
                await _nodes(as_node)
            assert refused.value.code is Status.PERMISSION_DENIED


async def test_register_approve_commit_watch_and_status(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        new_key = pki.generate_key()
        new_id = identity.node_id(new_key.public_key())
        join = pki.public_key_bytes(pki.generate_key())
        async with cl.owner() as owner:
            ticket = (
                await owner.unary(methods.GET_REGISTER_TICKET, m.GetRegisterTicketRequest())
            ).ticket
            again = (
                await owner.unary(methods.GET_REGISTER_TICKET, m.GetRegisterTicketRequest())
            ).ticket
            assert ticket == again and len(ticket) == 32

            async with open_client(
                [cl.endpoint], client_context(cl.ca), proof_key=new_key
            ) as anonymous:
                with pytest.raises(RPCError) as wrong:
                    await anonymous.unary(
                        methods.REGISTER_NODE,
                        c.RegisterNodeRequest(register_ticket=b"x" * 32, join_key=join),
                    )
                assert wrong.value.code is Status.PERMISSION_DENIED
                assert await read_node(cl.kv, new_id) is None

                request = c.RegisterNodeRequest(register_ticket=ticket, join_key=join)
                await anonymous.unary(methods.REGISTER_NODE, request)
                record = await read_node(cl.kv, new_id)
                assert record is not None and record.fsm_state == NodeState.NEW

                with pytest.raises(RPCError) as early:
                    await anonymous.unary(
                        methods.COMMIT_NODE, c.CommitNodeRequest(cluster_unlock_key=b"u" * 32)
                    )
                assert early.value.code is Status.FAILED_PRECONDITION

                await owner.unary(
                    methods.APPROVE_NODE,
                    m.ApproveNodeRequest(pubkey=pki.public_key_bytes(new_key)),
                )
                committed = await anonymous.unary(
                    methods.COMMIT_NODE, c.CommitNodeRequest(cluster_unlock_key=b"u" * 32)
                )
            credentials = identity.NodeCredentials.from_bytes(
                pki.encode_private_key(new_key),
                committed.node_certificate,
                committed.ca_certificate,
            )
            assert credentials.node_id == new_id
            states = {identity.node_id(n.pubkey): n.state for n in await _nodes(owner)}
            assert states[new_id] == NodeState.UP

            async with open_client([cl.endpoint], cl.node_context(credentials)) as node:
                with pytest.raises(RPCError) as other:
                    async with node.stream(
                        methods.WATCH,
                        c.WatchRequest(
                            node_in_cluster=c.WatchRequestNodeInCluster(node_id=cl.node.node_id)
                        ),
                    ) as call:
                        async for _ in call:
                            pass
                assert other.value.code is Status.PERMISSION_DENIED

                watch = c.WatchRequest(node_in_cluster=c.WatchRequestNodeInCluster(node_id=new_id))
                async with node.stream(methods.WATCH, watch) as call:
                    first = await call.__anext__()
                    assert [n.id for n in first.nodes] == [new_id]
                    assert first.nodes[0].status is None
                    await node.unary(
                        methods.UPDATE_NODE_STATUS,
                        c.UpdateNodeStatusRequest(
                            node_id=new_id,
                            status=NodeStatus(
                                external_address="127.0.0.2",
                                running_curator=NodeStatusRunningCurator(port=7835),
                            ),
                        ),
                    )
                    with trio.fail_after(BOUND):
                        second = await call.__anext__()
                    status = second.nodes[0].status
                    assert status is not None and status.external_address == "127.0.0.2"

                with pytest.raises(RPCError) as others:
                    await node.unary(
                        methods.UPDATE_NODE_STATUS,
                        c.UpdateNodeStatusRequest(node_id=cl.node.node_id, status=NodeStatus()),
                    )
                assert others.value.code is Status.PERMISSION_DENIED

            info = await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
            directory = info.cluster_directory
            assert directory is not None
            assert [n.addresses[0].host for n in directory.nodes] == ["127.0.0.2"]


async def test_status_updates_are_heartbeats_and_get_nodes_reports_health(
    tmp_path: Path,
) -> None:
    async with (
        cluster(tmp_path, heartbeat_timeout=1.0) as cl,
        cl.owner() as owner,
        open_client([cl.endpoint], cl.node_context(cl.node)) as node,
    ):
        [never] = await _nodes(owner)
        assert never.health == m.NodeHealth.UNKNOWN
        assert never.time_since_heartbeat is None

        request = c.UpdateNodeStatusRequest(
            node_id=cl.node.node_id, status=NodeStatus(external_address="127.0.0.1")
        )
        await node.unary(methods.UPDATE_NODE_STATUS, request)
        [heard] = await _nodes(owner)
        assert heard.health == m.NodeHealth.HEALTHY
        assert heard.time_since_heartbeat is not None

        # The same status again is only a heartbeat: the record (and so
        # every Watch of it) stays untouched.
        record = await cl.kv.get(node_key(cl.node.node_id))
        await node.unary(methods.UPDATE_NODE_STATUS, request)
        again = await cl.kv.get(node_key(cl.node.node_id))
        assert record is not None and again is not None
        assert again.mod_revision == record.mod_revision

        # Silence: the node times out (polling: only time passes here).
        with trio.fail_after(BOUND):
            while (await _nodes(owner))[0].health != m.NodeHealth.HEARTBEAT_TIMEOUT:  # noqa: ASYNC110
                await trio.sleep(0.1)
        [silent] = await _nodes(owner)
        assert silent.time_since_heartbeat is not None
        assert silent.time_since_heartbeat.total_seconds() > 1.0

        await node.unary(methods.UPDATE_NODE_STATUS, request)
        [back] = await _nodes(owner)
        assert back.health == m.NodeHealth.HEALTHY


async def test_bad_peers_are_refused_and_write_nothing(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        before = (await cl.kv.range(b"/", prefix=True)).revision
        # A certificate from another CA: the handshake refuses it.
        other_ca_key = pki.generate_key()
        other_ca = pki.new_ca(other_ca_key, "other CA")
        stranger = pki.generate_key()
        stranger_cert = pki.issue_certificate(
            other_ca_key, other_ca, stranger.public_key(), "owner", pki.Usage.CLIENT
        )
        async with open_client(
            [cl.endpoint], client_context(cl.ca, stranger_cert, stranger)
        ) as client:
            with pytest.raises(RPCError) as foreign:
                await client.unary(methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=b"x" * 32))
            assert foreign.value.code in (Status.UNAUTHENTICATED, Status.UNAVAILABLE)
        # No certificate at all on an owner method.
        async with open_client([cl.endpoint], client_context(cl.ca)) as client:
            with pytest.raises(RPCError) as none:
                await client.unary(methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=b"x" * 32))
            assert none.value.code is Status.UNAUTHENTICATED
        # A proof made with one key but claiming another: the signature fails.
        liar, claimed = pki.generate_key(), pki.generate_key()
        async with open_client([cl.endpoint], client_context(cl.ca), proof_key=liar) as client:
            request = c.RegisterNodeRequest(register_ticket=b"t" * 32, join_key=b"j" * 32)
            metadata = sign_proof(liar, methods.REGISTER_NODE.path, bytes(request))
            metadata["metropolis-pop-key-bin"] = sign_proof(
                claimed, methods.REGISTER_NODE.path, bytes(request)
            )["metropolis-pop-key-bin"]
            async with open_client([cl.endpoint], client_context(cl.ca)) as plain:
                with pytest.raises(RPCError) as forged:
                    await plain.unary(methods.REGISTER_NODE, request, metadata=metadata)
            assert forged.value.code is Status.UNAUTHENTICATED
        assert (await cl.kv.range(b"/", prefix=True)).revision == before


async def test_consensus_role_refusals_write_nothing(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        before = (await cl.kv.range(b"/", prefix=True)).revision
        async with cl.owner() as owner:
            with pytest.raises(RPCError) as last:
                await owner.unary(
                    methods.UPDATE_NODE_ROLES,
                    m.UpdateNodeRolesRequest(id=cl.node.node_id, consensus_member=False),
                )
            assert last.value.code is Status.FAILED_PRECONDITION
            assert "last" in last.value.message
            with pytest.raises(RPCError) as missing:
                await owner.unary(
                    methods.UPDATE_NODE_ROLES,
                    m.UpdateNodeRolesRequest(id="metropolis-00", consensus_member=True),
                )
            assert missing.value.code is Status.NOT_FOUND
        assert (await cl.kv.range(b"/", prefix=True)).revision == before
        record = await read_node(cl.kv, cl.node.node_id)
        assert record is not None and record.roles is not None
        assert record.roles.consensus_member is not None


async def test_a_certificate_on_the_cluster_crl_is_refused(tmp_path: Path) -> None:
    async with cluster(tmp_path) as cl:
        owner_cert = pki.issue_certificate(
            cl.ca_key, cl.ca, cl.owner_key.public_key(), "owner", pki.Usage.CLIENT
        )
        context = client_context(cl.ca, owner_cert, cl.owner_key)
        async with open_client([cl.endpoint], context) as owner:
            await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
            # Another curator revoked it: this one follows the CRL in etcd.
            crl = pki.new_crl(cl.ca_key, cl.ca, [owner_cert.serial_number])
            await cl.kv.put(CRL_KEY, pki.encode_crl(crl, pki.Encoding.DER))
            with trio.fail_after(BOUND):
                while True:
                    try:
                        await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
                    except RPCError as e:
                        assert e.code is Status.UNAUTHENTICATED
                        assert "revoked" in e.message
                        break
                    await trio.sleep(0.05)
            before = (await cl.kv.range(b"/", prefix=True)).revision
            with pytest.raises(RPCError) as refused:
                await owner.unary(
                    methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=cl.node.public_key)
                )
            assert refused.value.code is Status.UNAUTHENTICATED
            assert (await cl.kv.range(b"/", prefix=True)).revision == before


async def _joined(cl: Cluster, owner: Client, address: str) -> identity.NodeCredentials:
    """A node registered, approved and committed in-process, its address reported."""
    key = pki.generate_key()
    ticket = (await owner.unary(methods.GET_REGISTER_TICKET, m.GetRegisterTicketRequest())).ticket
    join = pki.public_key_bytes(pki.generate_key())
    async with open_client([cl.endpoint], client_context(cl.ca), proof_key=key) as anonymous:
        await anonymous.unary(
            methods.REGISTER_NODE, c.RegisterNodeRequest(register_ticket=ticket, join_key=join)
        )
        await owner.unary(
            methods.APPROVE_NODE, m.ApproveNodeRequest(pubkey=pki.public_key_bytes(key))
        )
        committed = await anonymous.unary(
            methods.COMMIT_NODE, c.CommitNodeRequest(cluster_unlock_key=b"u" * 32)
        )
    credentials = identity.NodeCredentials.from_bytes(
        pki.encode_private_key(key), committed.node_certificate, committed.ca_certificate
    )
    async with open_client([cl.endpoint], cl.node_context(credentials)) as node:
        await node.unary(
            methods.UPDATE_NODE_STATUS,
            c.UpdateNodeStatusRequest(
                node_id=credentials.node_id, status=NodeStatus(external_address=address)
            ),
        )
    return credentials


async def test_a_learner_that_never_starts_is_removed_at_the_next_grant(tmp_path: Path) -> None:
    async with cluster(tmp_path, learner_timeout=0.5) as cl, cl.owner() as owner:
        stuck = await _joined(cl, owner, "127.0.0.2")
        later = await _joined(cl, owner, "127.0.0.3")
        await owner.unary(
            methods.UPDATE_NODE_ROLES,
            m.UpdateNodeRolesRequest(id=stuck.node_id, consensus_member=True),
        )
        members = await cl.status.members()
        assert [m.is_learner for m in members if not m.name] == [True]
        # It never starts its etcd. Past the timeout, the next grant removes it
        # (etcd would refuse a second learner otherwise).
        await trio.sleep(1.0)
        with trio.fail_after(BOUND):
            await owner.unary(
                methods.UPDATE_NODE_ROLES,
                m.UpdateNodeRolesRequest(id=later.node_id, consensus_member=True),
            )
        urls = [u for member in await cl.status.members() for u in member.peer_urls]
        assert not any("127.0.0.2" in u for u in urls)
        assert any("127.0.0.3" in u for u in urls)
        record = await read_node(cl.kv, stuck.node_id)
        assert record is not None and record.roles is not None
        assert record.roles.consensus_member is None


async def test_watch_of_all_nodes_sends_statuses_and_role_names_only(tmp_path: Path) -> None:
    """What nodes keep their cluster directory with: every node, then each change."""
    async with cluster(tmp_path) as cl:
        own = cl.node.node_id
        request = c.WatchRequest(nodes_in_cluster=c.WatchRequestNodesInCluster())
        async with (
            open_client([cl.endpoint], cl.node_context(cl.node)) as node,
            node.stream(methods.WATCH, request) as call,
        ):
            with trio.fail_after(BOUND):
                first = await call.__anext__()
            assert first.progress == c.WatchEventProgress.LAST_BACKLOGGED
            assert [n.id for n in first.nodes] == [own]
            roles = first.nodes[0].roles
            # The role is named, its join data (peer certificate, CA) is not sent.
            assert roles is not None and roles.consensus_member is not None
            assert roles.consensus_member.peer_certificate == b""
            status = NodeStatus(
                external_address="127.0.0.1",
                running_curator=NodeStatusRunningCurator(port=cl.endpoint.port),
            )
            await node.unary(
                methods.UPDATE_NODE_STATUS, c.UpdateNodeStatusRequest(node_id=own, status=status)
            )
            with trio.fail_after(BOUND):
                second = await call.__anext__()
            assert [(n.id, n.status) for n in second.nodes] == [(own, status)]


async def test_a_large_backlog_comes_in_chunks_the_last_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More nodes than a chunk: several events, only the last LAST_BACKLOGGED."""
    monkeypatch.setattr(nodeapi, "BACKLOG_CHUNK", 2)
    async with cluster(tmp_path) as cl, cl.owner() as owner:
        joined = [await _joined(cl, owner, f"127.0.0.{i}") for i in (2, 3, 4, 5)]
        request = c.WatchRequest(nodes_in_cluster=c.WatchRequestNodesInCluster())
        async with (
            open_client([cl.endpoint], cl.node_context(cl.node)) as node,
            node.stream(methods.WATCH, request) as call,
        ):
            events: list[c.WatchEvent] = []
            with trio.fail_after(BOUND):
                while not events or events[-1].progress != c.WatchEventProgress.LAST_BACKLOGGED:
                    events.append(await call.__anext__())
        assert [len(e.nodes) for e in events] == [2, 2, 1]
        assert [e.progress for e in events[:-1]] == [c.WatchEventProgress.UNSPECIFIED] * 2
        ids = [n.id for e in events for n in e.nodes]
        assert sorted(ids) == sorted([cl.node.node_id, *(j.node_id for j in joined)])


async def test_the_api_serves_while_the_campaigns_lease_is_granted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is published once the API is loaded and bound, not after the lease.

    Until the campaign's outcome is published the API answers UNAVAILABLE,
    as it did while a granted lease's campaign was in flight; then it leads.
    """
    async with consensus(tmp_path) as (service, _, status):
        owner_key = pki.generate_key()
        result, credentials = await bootstrapped(
            service, status, owner_public_key=pki.public_key_bytes(owner_key)
        )
        stored = await status.curator_client().get(CA_KEY_KEY)
        assert stored is not None
        release = trio.Event()
        real_grant = KV.grant

        async def held_grant(self: KV, ttl: int) -> Lease:
            await release.wait()
            return await real_grant(self, ttl)

        monkeypatch.setattr(KV, "grant", held_grant)
        curator = Curator(
            service.status, credentials.node_id, credentials=credentials, listen=("127.0.0.1", 0)
        )
        async with open_supervisor(curator.run, name="curator"):
            with trio.fail_after(BOUND):
                with curator.port.watch() as w:
                    port = await w.get()
            cl = Cluster(
                status,
                status.curator_client(),
                Endpoint("127.0.0.1", port, credentials.public_key),
                result.ca_certificate,
                pki.decode_private_key(stored.value),
                credentials,
                owner_key,
            )
            async with cl.owner() as owner:
                with pytest.raises(RPCError) as early:
                    await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
                assert early.value.code is Status.UNAVAILABLE
                release.set()
                with trio.fail_after(BOUND):
                    with curator.election.watch() as e:
                        await e.get(lambda s: isinstance(s, Leader))
                info = await owner.unary(methods.GET_CLUSTER_INFO, m.GetClusterInfoRequest())
                assert pki.decode_certificate(info.ca_certificate) == cl.ca


async def test_an_api_that_fails_to_load_releases_its_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is bound while the API loads; if loading fails, the port is
    released at once, so the restarted curator can bind it again."""
    async with consensus(tmp_path) as (service, _, status):
        _, credentials = await bootstrapped(service, status)
        port = free_loopback_port()
        opened: list[str] = []
        three = trio.Event()
        bound_send, bound_receive = trio.open_memory_channel[None](10)
        real_open = trio.open_tcp_listeners

        async def open_then_signal(port: int, *, host: str | None = None) -> list[Any]:
            try:
                listeners = await real_open(port, host=host)
            except OSError as e:
                opened.append(f"errno {e.errno}")
                raise
            else:
                opened.append("bound")
                bound_send.send_nowait(None)
                return listeners
            finally:
                if len(opened) >= 3:
                    three.set()

        async def failing_load(*args: object, **kwargs: object) -> CuratorServer:
            await bound_receive.receive()  # this run's port is bound
            raise CuratorError("damaged state (injected)")

        monkeypatch.setattr(trio, "open_tcp_listeners", open_then_signal)
        monkeypatch.setattr(CuratorServer, "load", failing_load)
        curator = Curator(
            service.status, credentials.node_id, credentials=credentials, listen=("127.0.0.1", port)
        )
        async with open_supervisor(curator.run, name="curator"):
            with trio.fail_after(BOUND):
                await three.wait()
        # Each run bound the port (EADDRINUSE if an earlier run's listener leaked).
        assert opened[:3] == ["bound"] * 3, opened
