"""The curator core on a real etcd: records, bootstrap, election, following consensus."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.consensus import Config, Service, Status
from metropolis.consensus.client import (
    KV,
    Client,
    Compare,
    EtcdAPIError,
    EtcdUnavailable,
    LeaseExpired,
    Put,
)
from metropolis.consensus.localetcd import LOOPBACK_TUNING, kill_etcd
from metropolis.curator import service as curator_service
from metropolis.curator.bootstrap import BootstrapResult, bootstrap_cluster
from metropolis.curator.election import ElectionState, Follower, Leader, NotLeader, run_election
from metropolis.curator.service import Curator
from metropolis.curator.state import (
    CuratorError,
    consensus_removal_key,
    node_key,
    read_node,
    watch_node,
)
from metropolis.event import Value
from metropolis.localstorage import Root
from metropolis.proto.common import NodeRoles, NodeRolesKubernetesWorker, NodeState
from metropolis.proto.curator import LeaderElectionValue, Node
from metropolis.supervisor import BackoffPolicy, State, Supervisor, open_supervisor

BOUND = 60


@asynccontextmanager
async def consensus(
    tmp_path: Path, *, policy: BackoffPolicy | None = None
) -> AsyncIterator[tuple[Service, Supervisor, Status]]:
    """A one-member consensus, supervised (with ``policy``: its restarts' backoff)."""
    root = Root(tmp_path / "n")
    root.create()
    service = Service(
        Config(
            data=root.data.etcd,
            ephemeral=root.ephemeral.consensus,
            node_private_key=pki.generate_key(),
            peer_address=f"127.0.0.1:{free_loopback_port()}",
            tuning=LOOPBACK_TUNING,
        )
    )
    async with open_supervisor(service.run, name="consensus", policy=policy) as supervisor:
        with trio.fail_after(BOUND):
            status = await service.wait_running()
        yield service, supervisor, status


async def bootstrapped(
    service: Service, status: Status, *, owner_public_key: bytes | None = None
) -> tuple[BootstrapResult, identity.NodeCredentials]:
    """The cluster bootstrapped by ``service``'s node (fresh join and owner keys
    unless given), and that node's credentials."""
    node_key = service.config.node_private_key
    result = await bootstrap_cluster(
        status,
        node_public_key=pki.public_key_bytes(node_key),
        join_public_key=pki.public_key_bytes(pki.generate_key()),
        cluster_unlock_key=b"k" * 32,
        owner_public_key=owner_public_key or pki.public_key_bytes(pki.generate_key()),
    )
    return result, identity.NodeCredentials(
        node_key, result.node_certificate, result.ca_certificate
    )


def _keys() -> dict[str, bytes]:
    return {name: pki.public_key_bytes(pki.generate_key()) for name in ("node", "join", "owner")}


async def _all_keys(status: Status) -> list[bytes]:
    result = await status.curator_client().range(b"/", prefix=True)
    return [kv.key for kv in result.kvs]


async def test_bootstrap_cluster_is_one_idempotent_step(tmp_path: Path) -> None:
    async with consensus(tmp_path) as (service, _, status):
        key = pki.public_key_bytes(service.config.node_private_key)
        join, owner = _keys()["join"], _keys()["owner"]

        async def bootstrap(join_key: bytes) -> BootstrapResult:
            return await bootstrap_cluster(
                status,
                node_public_key=key,
                join_public_key=join_key,
                cluster_unlock_key=b"cuk",
                owner_public_key=owner,
            )

        first = await bootstrap(join)
        keys = await _all_keys(status)
        node = identity.node_id(key)
        assert sorted(keys) == sorted(
            [
                b"/cluster-pki/ca/certificate",
                b"/cluster-pki/ca/key",
                b"/cluster-pki/issued/node-" + node.encode(),
                b"/global/initial_owner",
                b"/join_keys/" + join.hex().encode(),
                node_key(node),
            ]
        )
        record = await read_node(status.curator_client(), node)
        assert record is not None and record == first.record
        assert record.fsm_state == NodeState.UP
        assert record.roles is not None
        assert record.roles.consensus_member is not None
        assert record.roles.kubernetes_controller is not None
        # The node certificate makes valid node credentials.
        identity.NodeCredentials(
            service.config.node_private_key, first.node_certificate, first.ca_certificate
        )

        # Again: same cluster, nothing new written.
        second = await bootstrap(join)
        assert second.ca_certificate == first.ca_certificate
        assert pki.public_key_bytes(second.ca_key) == pki.public_key_bytes(first.ca_key)
        assert second.node_certificate == first.node_certificate
        assert await _all_keys(status) == keys

        # Another node's bootstrap on the same cluster is refused.
        with pytest.raises(CuratorError):
            await bootstrap(_keys()["join"])


async def test_election_one_leader_failover_and_guarded_writes(tmp_path: Path) -> None:
    async with consensus(tmp_path) as (_, _, status):
        kv = status.curator_client()
        a_state: Value[Leader | Follower] = Value()
        b_state: Value[Leader | Follower] = Value()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                a_scope = trio.CancelScope()

                async def run_a(task_status: trio.TaskStatus[None]) -> None:
                    with a_scope:
                        await run_election(kv, "node-a", a_state, task_status=task_status)

                await nursery.start(run_a)
                with a_state.watch() as w:
                    a_lead = await w.get(lambda s: isinstance(s, Leader))
                nursery.start_soon(lambda: run_election(kv, "node-b", b_state))
                with b_state.watch() as w:
                    b_follow = await w.get()
                assert isinstance(b_follow, Follower) and b_follow.leader is not None
                assert b_follow.leader == LeaderElectionValue(node_id="node-a", ttl=10)

                assert isinstance(a_lead, Leader)
                assert (await a_lead.txn(kv, [], [Put(b"x", b"a")])).succeeded
                # a stops (its lease is revoked): b takes over without waiting a TTL.
                a_scope.cancel()
                with b_state.watch() as w:
                    b_lead = await w.get(lambda s: isinstance(s, Leader))
                assert isinstance(b_lead, Leader)
                with pytest.raises(NotLeader):
                    await a_lead.txn(kv, [], [Put(b"x", b"stale")])
                assert (await kv.get(b"x")).value == b"a"  # type: ignore[union-attr]
                # A failing compare with leadership intact is just a failed txn.
                failed = await b_lead.txn(kv, [Compare.absent(b"x")], [Put(b"x", b"b")])
                assert not failed.succeeded
                nursery.cancel_scope.cancel()


async def test_a_leader_marked_for_removal_resigns_and_stays_out(tmp_path: Path) -> None:
    """Its own removal mark ends a leader's term; it cannot lead until the mark goes."""
    async with consensus(tmp_path) as (_, _, status):
        kv = status.curator_client()
        a_state: Value[ElectionState] = Value()
        b_state: Value[ElectionState] = Value()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(run_election, kv, "a", a_state))
                with a_state.watch() as w:
                    a_lead = await w.get(lambda s: isinstance(s, Leader))
                b_scope, c_scope = trio.CancelScope(), trio.CancelScope()

                async def run(
                    scope: trio.CancelScope, name: str, state: Value[ElectionState]
                ) -> None:
                    with scope:
                        await run_election(kv, name, state)

                nursery.start_soon(run, b_scope, "b", b_state)
                with b_state.watch() as w:
                    await w.get(lambda s: isinstance(s, Follower) and s.leader is not None)

                await kv.put(consensus_removal_key("a"), b"a's key")
                with b_state.watch() as w:
                    b_lead = await w.get(lambda s: isinstance(s, Leader))
                assert isinstance(a_lead, Leader) and isinstance(b_lead, Leader)
                with pytest.raises(NotLeader):
                    await a_lead.txn(kv, [], [Put(b"x", b"stale")])
                # b stops: a (marked) must not take over; c, starting later, does.
                b_scope.cancel()
                c_state: Value[ElectionState] = Value()
                nursery.start_soon(run, c_scope, "c", c_state)

                def decided(s: ElectionState) -> bool:
                    following = s.leader.node_id if isinstance(s, Follower) and s.leader else ""
                    return isinstance(s, Leader) or following == "a"

                with c_state.watch() as w:
                    assert isinstance(await w.get(decided), Leader)
                # The removal is done (the mark goes): a may lead again.
                await kv.delete(consensus_removal_key("a"))
                c_scope.cancel()
                with a_state.watch() as w:
                    assert isinstance(await w.get(lambda s: isinstance(s, Leader)), Leader)
                nursery.cancel_scope.cancel()


async def test_stale_election_key_of_this_node_is_taken_over(tmp_path: Path) -> None:
    async with consensus(tmp_path) as (_, _, status):
        kv = status.curator_client()
        # The key of our previous life, on a lease that lives on (TTL 60 s).
        lease = await kv.grant(60)
        await kv.put(b"/leader", bytes(LeaderElectionValue(node_id="me", ttl=10)), lease=lease.id)
        state: Value[Leader | Follower] = Value()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: run_election(kv, "me", state))
                with state.watch() as w:
                    assert isinstance(await w.get(lambda s: isinstance(s, Leader)), Leader)
                nursery.cancel_scope.cancel()


async def test_a_curator_campaigns_on_a_lease_granted_for_it_once(tmp_path: Path) -> None:
    """The bootstrap grants the first lease early; the curator leads on it, revokes it on
    the way out, and a restarted curator grants its own."""
    async with consensus(tmp_path) as (service, _, status):
        kv = status.curator_client()
        granted = await kv.grant(10)
        curator = Curator(service.status, "me", lease=granted)
        leases: list[int] = []
        with trio.fail_after(BOUND):
            for _ in range(2):
                async with open_supervisor(curator.run, name="curator"):
                    with curator.election.watch() as w:
                        # (The value keeps the first run's term until the second leads.)
                        leader = await w.get(
                            lambda s: isinstance(s, Leader) and s.lease_id not in leases
                        )
                    assert isinstance(leader, Leader)
                    leases.append(leader.lease_id)
        assert leases[0] == granted.id and leases[1] != granted.id
        with pytest.raises(LeaseExpired):
            await kv.keep_alive_once(granted.id)  # revoked when the first run ended


async def test_a_serving_curator_listens_before_it_leads(tmp_path: Path) -> None:
    """Whoever sees the curator lead can call it: with its lease at hand it could
    campaign before its API listens, and must not."""
    async with consensus(tmp_path) as (service, _, status):
        _, credentials = await bootstrapped(service, status)
        curator = Curator(
            service.status,
            credentials.node_id,
            credentials=credentials,
            listen=("127.0.0.1", 0),
            lease=await status.curator_client().grant(10),
        )
        order: list[str] = []

        async def leads() -> None:
            with curator.election.watch() as w:
                await w.get(lambda s: isinstance(s, Leader))
            order.append("leads")

        async def listens() -> None:
            with curator.port.watch() as w:
                await w.get()
            order.append("listens")

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(leads)
                nursery.start_soon(listens)
                await trio.testing.wait_all_tasks_blocked()  # both watch before it starts
                async with open_supervisor(curator.run, name="curator"):
                    while len(order) < 2:  # noqa: ASYNC110
                        await trio.sleep(0.01)
        assert order == ["listens", "leads"]


async def test_watch_node_sees_the_record_and_every_change(tmp_path: Path) -> None:
    async with consensus(tmp_path) as (_, _, status):
        kv: KV = status.curator_client()
        seen: list[NodeRoles | None] = []
        with trio.fail_after(BOUND):
            async with watch_node(kv, "n1") as records:
                await kv.put(node_key("n1"), bytes(Node(roles=NodeRoles())))
                await kv.put(
                    node_key("n1"),
                    bytes(Node(roles=NodeRoles(kubernetes_worker=NodeRolesKubernetesWorker()))),
                )
                await kv.delete(node_key("n1"))
                async for record in records:
                    seen.append(None if record is None else record.roles)
                    if len(seen) == 4:
                        break
        assert seen[0] is None  # nothing at first
        assert seen[1] == NodeRoles()
        assert seen[2] is not None and seen[2].kubernetes_worker is not None
        assert seen[3] is None


async def test_curator_leads_and_restarts_when_consensus_restarts(tmp_path: Path) -> None:
    async with consensus(tmp_path) as (service, _, status):
        curator = Curator(service.status, status.node_id)
        with trio.fail_after(BOUND):
            async with open_supervisor(curator.run, name="curator") as cs:
                with curator.election.watch() as w:
                    await w.get(lambda s: isinstance(s, Leader))
                # Consensus restarts (a new etcd client): the curator restarts
                # on request, which is not a failure, and leads again.
                kill_etcd(service.config.ephemeral)
                with service.status.watch() as sw:
                    await sw.get(lambda s: not s.running)
                with curator.election.watch() as w:
                    await w.get(lambda s: isinstance(s, Follower))
                    await w.get(lambda s: isinstance(s, Leader))
                [info] = [i for i in cs.snapshot() if i.name == "curator"]
                assert info.restarts >= 1 and info.last_error is None


@asynccontextmanager
async def _etcd_gone_under_a_running_status(
    tmp_path: Path,
) -> AsyncIterator[tuple[Value[Status], Status]]:
    """A status that says running while its etcd is gone, and the one that says not.

    The moment between etcd leaving by itself (its member removed) and the
    consensus service saying so, held open: the etcd is killed, its service
    waits a minute before restarting it, and the curator follows a value of
    the test's holding the last running status, on an open client.
    """
    async with (
        consensus(tmp_path, policy=BackoffPolicy(initial=60, jitter=0)) as (service, _, status),
        Client(service.config.client_socket) as client,
    ):
        kill_etcd(service.config.ephemeral)
        with trio.fail_after(BOUND), service.status.watch() as w:
            stopped = await w.get(lambda s: not s.running)
        running = Status(
            running=True,
            node_id=status.node_id,
            peer_url=status.peer_url,
            member_id=status.member_id,
            _client=client,
            _config=service.config,
        )
        value = Value[Status]()
        value.set(running)
        yield value, stopped


async def test_etcd_gone_as_consensus_stops_restarts_the_curator_on_request(
    tmp_path: Path,
) -> None:
    """EtcdUnavailable, then the consensus status changes: the stop, not a failure."""
    async with _etcd_gone_under_a_running_status(tmp_path) as (value, stopped):
        curator = Curator(value.readonly(), stopped.node_id)
        with trio.fail_after(BOUND):
            async with open_supervisor(curator.run, name="curator") as cs:
                # Its lease grant is refused; it waits for consensus to change.
                await trio.testing.wait_all_tasks_blocked(cushion=0.1)
                assert cs.restart_totals() == {}
                assert cs.state("curator") is not State.BACKOFF
                value.set(stopped)
                await trio.testing.wait_all_tasks_blocked(cushion=0.1)
                assert cs.restart_totals() == {("curator", "request"): 1}
                [info] = [i for i in cs.snapshot() if i.name == "curator"]
                assert info.last_error is None


async def test_etcd_gone_under_a_running_consensus_is_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EtcdUnavailable and no consensus change within the grace: the curator fails."""
    monkeypatch.setattr(curator_service, "ETCD_GONE_GRACE", 0.2)
    async with _etcd_gone_under_a_running_status(tmp_path) as (value, stopped):
        curator = Curator(value.readonly(), stopped.node_id)
        with trio.fail_after(BOUND):
            async with open_supervisor(curator.run, name="curator") as cs:
                await cs.wait_state("curator", State.BACKOFF)
                assert cs.restart_totals() == {}  # counted once the backoff is over
        [failed] = [r for r in caplog.records if r.name == "curator" and r.levelname == "ERROR"]
        assert failed.exc_info is not None
        error = failed.exc_info[1]
        assert isinstance(error, ExceptionGroup)
        assert error.split(EtcdUnavailable)[1] is None


def test_a_member_answering_that_it_stops_is_gone_like_an_unreachable_one() -> None:
    """etcd's "raft: stopped" to the requests in flight as a removed member
    stops is the same planned stop as its socket refusing; other answers
    are failures."""
    stopping = EtcdAPIError("raft: stopped", 2, 500)
    assert stopping.stopping
    assert curator_service._only(
        ExceptionGroup("nursery", [ExceptionGroup("inner", [stopping, EtcdUnavailable("gone")])]),
        curator_service._etcd_gone_or_restart,
    )
    refused = EtcdAPIError("etcdserver: too many requests", 8, 429)
    assert not refused.stopping
    assert not curator_service._only(
        ExceptionGroup("nursery", [stopping, refused]), curator_service._etcd_gone_or_restart
    )
