"""The consensus service on real etcd processes: bootstrap, join, crash, revocation."""

from __future__ import annotations

import dataclasses
import logging
import signal
import ssl
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common import durable
from common.backoff import ExponentialBackoff, Retrier
from common.net import free_loopback_port
from metropolis import identity, pki
from metropolis.consensus import (
    Config,
    ConsensusError,
    ExistingNode,
    JoinCluster,
    NotRunning,
    Service,
    Status,
    peerpki,
)
from metropolis.consensus import service as service_module
from metropolis.consensus.client import Client, EtcdClosed, Get, RangeResult
from metropolis.consensus.localetcd import LOOPBACK_TUNING, etcd_pid, kill_etcd
from metropolis.consensus.peerhosts import peer_hosts
from metropolis.consensus.removal import REMOVAL_PANIC
from metropolis.localstorage import Root
from metropolis.proto.common import NodeRolesConsensusMember
from metropolis.supervisor import State, Supervisor, open_supervisor

# Safety bound for waits; joins include etcd's fixed 5 s member health window.
BOUND = 60


@dataclass
class Machine:
    """One simulated node: its storage, key and peer port."""

    root: Root
    key: Ed25519PrivateKey
    port: int
    promote_interval: float = 0.2
    #: etcd's member health wait (see ``Tuning.member_health_wait``).
    health_wait: bool = True

    @classmethod
    def make(cls, path: Path) -> Machine:
        root = Root(path)
        root.create()
        return cls(root, pki.generate_key(), free_loopback_port())

    @property
    def public_key(self) -> bytes:
        return pki.public_key_bytes(self.key)

    @property
    def peer_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def config(self, join: JoinCluster | None = None) -> Config:
        return Config(
            data=self.root.data.etcd,
            ephemeral=self.root.ephemeral.consensus,
            node_private_key=self.key,
            peer_address=f"127.0.0.1:{self.port}",
            join_cluster=join,
            tuning=dataclasses.replace(LOOPBACK_TUNING, member_health_wait=self.health_wait),
            promote_interval=self.promote_interval,
        )


@asynccontextmanager
async def running(
    machine: Machine, join: JoinCluster | None = None
) -> AsyncIterator[tuple[Service, Supervisor, Status]]:
    """Run a consensus service under a supervisor; yield once it reports running."""
    service = Service(machine.config(join))
    async with open_supervisor(service.run, name="consensus") as supervisor:
        with trio.fail_after(BOUND), service.status.watch() as watcher:
            status = await watcher.get(lambda s: s.running)
        yield service, supervisor, status


async def eventually(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` until it holds (callers bound the wait)."""
    while True:
        if predicate():
            return
        await trio.sleep(0.05)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_bootstrap_single_node(tmp_path: Path) -> None:
    machine = Machine.make(tmp_path / "n1")
    etcd_dir = machine.root.data.etcd
    async with running(machine) as (service, _, status):
        assert status.node_id == identity.node_id(machine.public_key)
        async with Client(service.config.client_socket) as client:
            # etcd answers on the socket, and we are its only, voting member.
            await client.put("hello", "world")
            assert (await client.get("hello")).value == b"world"  # type: ignore[union-attr]
            [member] = await client.member_list()
            assert member.name == status.node_id and not member.is_learner
            assert member.peer_urls == [machine.peer_url]

            # The peer PKI lives in etcd, and the files on disk are that PKI.
            pki_kv = client.namespaced(peerpki.NAMESPACE)
            ca = await peerpki.load_ca(pki_kv)
            on_disk_ca = pki.decode_certificate(etcd_dir.peer_pki.ca_certificate.read_bytes())
            assert ca.certificate == on_disk_ca
            stored = await pki_kv.get(b"certificates/" + status.node_id.encode())
            assert stored is not None
            on_disk_cert = pki.decode_certificate(etcd_dir.peer_pki.certificate.read_bytes())
            assert pki.decode_certificate(stored.value) == on_disk_cert
            pki.verify_signed_by(on_disk_cert, ca.certificate)
            crl, _ = await peerpki.get_crl(pki_kv)
            assert pki.decode_crl(etcd_dir.peer_crl.read_bytes()) == crl

            # The curator's view is confined to its namespace.
            await status.curator_client().put("nodes/x", "record")
            assert await client.get("namespaced/curator/nodes/x") is not None

            # Asking for our own join data adds nobody; another node needs its URL.
            join = await status.add_node(machine.public_key)
            assert join.node_certificate == on_disk_cert and join.existing_nodes == ()
            assert len(await client.member_list()) == 1
            with pytest.raises(ValueError, match="peer URL"):
                await status.add_node(pki.public_key_bytes(pki.generate_key()))
            assert len(await client.member_list()) == 1

            # The join data fits our key and no other.
            join.check(machine.key)
            with pytest.raises(ConsensusError, match="not for this node"):
                join.check(pki.generate_key())

        # Secrets on disk are owner-only.
        for directory in (etcd_dir.path, etcd_dir.peer_pki.path, service.config.ephemeral):
            assert _mode(directory) == 0o700, directory
        for path in (*etcd_dir.peer_pki.files(), etcd_dir.peer_crl):
            assert _mode(path) == 0o600, path

    # Leaving the supervisor stopped etcd and withdrew the status.
    assert etcd_pid(service.config.ephemeral) is None
    with service.status.watch() as watcher:
        final = await watcher.get()
    assert not final.running
    with pytest.raises(NotRunning):
        final.curator_client()
    with pytest.raises(EtcdClosed):
        await status.add_node(machine.public_key)  # an old snapshot's client is closed too


async def test_bootstrap_starts_etcd_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    machine = Machine.make(tmp_path / "n1")
    caplog.set_level(logging.INFO, logger="consensus.etcd")
    async with running(machine) as (service, _, status):
        assert await service.wait_running() == status
    starts = [r for r in caplog.records if r.getMessage().startswith("starting etcd:")]
    assert len(starts) == 1, [r.getMessage()[:80] for r in starts]
    assert "--peer-cert-file" in starts[0].getMessage()  # peer TLS from the first start
    assert not (machine.root.data.etcd.path / "bootstrap_ca_key.pem").exists()


async def test_bootstrap_knows_its_join_data_and_etcd_early_only_once(
    tmp_path: Path,
) -> None:
    """Before etcd answers, a bootstrap publishes the join data add_node gives later; once
    etcd answers, the curator's keys, before running; a restart does neither."""
    machine = Machine.make(tmp_path / "n1")
    early_writes: list[bool] = []  # whether running was published when etcd was handed out
    wrote = trio.Event()

    for attempt in range(2):
        service = Service(machine.config())

        async def write_early(service: Service = service) -> None:
            with service.bootstrap_kv.watch() as watcher:
                kv = await watcher.get(lambda kv: kv is not None)
            assert kv is not None
            with service.status.watch() as status:
                early_writes.append((await status.get()).running)
            await kv.put("created-early", "yes")
            wrote.set()

        async with open_supervisor(service.run, name="consensus"), trio.open_nursery() as n:
            n.start_soon(write_early)
            with trio.fail_after(BOUND):
                with service.bootstrap_join.watch() as watcher:
                    early = await watcher.get()
                status = await service.wait_running()
            if attempt == 0:
                assert early is not None
                assert early == await status.add_node(machine.public_key)
                with trio.fail_after(BOUND):
                    await wrote.wait()
                assert early_writes == [False]  # before running was published
            else:
                assert early is None  # a restart: the cluster exists, ask etcd
                with service.bootstrap_kv.watch() as kv_watcher:
                    assert await kv_watcher.get() is None  # and etcd is not handed out early
                n.cancel_scope.cancel()
            stored = await status.curator_client().get("created-early")
            assert stored is not None and stored.value == b"yes"
    assert early_writes == [False]


async def test_bootstrap_writes_beside_etcd_only_once_its_server_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PKI's fsync and the join data for the caller's writes wait for etcd's start."""
    machine = Machine.make(tmp_path / "n1")
    caplog.set_level(logging.INFO, logger="consensus.etcd")
    seen: list[str] = []

    def server_started() -> bool:
        return any("now serving peer/client/metrics" in r.getMessage() for r in caplog.records)

    def make_durable(paths: list[Path]) -> None:
        seen.append(f"fsync after start: {server_started()}")
        durable.make_durable(paths)

    monkeypatch.setattr(service_module, "make_durable", make_durable)
    service = Service(machine.config())
    async with open_supervisor(service.run, name="consensus"):
        with trio.fail_after(BOUND), service.bootstrap_join.watch() as watcher:
            assert await watcher.get() is not None
            seen.append(f"join data after start: {server_started()}")
            await service.wait_running()
    assert sorted(seen) == ["fsync after start: True", "join data after start: True"]


async def test_bootstrap_interrupted_before_the_pki_is_stored_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd ran, but the node died before the PKI reached etcd: the next start stores it."""
    machine = Machine.make(tmp_path / "n1")
    real = peerpki.store_bootstrap
    calls = 0

    async def crash_once(*args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected crash before the PKI is stored")
        await real(*args)

    monkeypatch.setattr(peerpki, "store_bootstrap", crash_once)
    async with running(machine) as (service, supervisor, status):
        assert supervisor.restarts("consensus") == 1
        async with Client(service.config.client_socket) as client:
            ca = await peerpki.load_ca(client.namespaced(peerpki.NAMESPACE))
        on_disk = pki.decode_certificate(
            machine.root.data.etcd.peer_pki.ca_certificate.read_bytes()
        )
        assert ca.certificate == on_disk
        assert not (machine.root.data.etcd.path / "bootstrap_ca_key.pem").exists()
        join = await status.add_node(machine.public_key)
        assert join.ca_certificate == on_disk


def test_ipv6_peer_address_gets_an_ip_san() -> None:
    ca, _ = peerpki.new_ca()
    key = pki.public_key_bytes(pki.generate_key())
    certificate = peerpki.issue_local_certificate(ca, key, peer_hosts("[::1]:7834"))
    sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["::1"]
    assert sans.get_values_for_type(x509.DNSName) == [identity.node_id(key)]


def test_a_loopback_peer_address_also_names_the_loopback_source() -> None:
    """A bootstrapped node on 127.0.1.1 dials its peers from 127.0.0.1, the
    address etcd checks its certificate against."""
    assert peer_hosts("127.0.1.1:7834") == ["127.0.1.1", "127.0.0.1"]
    assert peer_hosts("127.0.0.1:7834") == ["127.0.0.1"]
    assert peer_hosts("192.0.2.10:7834") == ["192.0.2.10"]
    assert peer_hosts("node.example:7834") == ["node.example"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_a_killed_etcd_is_restarted_on_same_data(tmp_path: Path, sig: signal.Signals) -> None:
    """A crash, or a stop nobody here asked for (an operator's SIGTERM: etcd
    then dies of the signal, it does not exit 0 as when its member is
    removed), restarts etcd on its data."""
    machine = Machine.make(tmp_path / "n1")
    async with running(machine) as (service, supervisor, status):
        await status.curator_client().put("survivor", "yes")
        old_pid = kill_etcd(service.config.ephemeral, sig)

        with trio.fail_after(BOUND), service.status.watch() as watcher:
            await watcher.get(lambda s: not s.running)
            restarted = await watcher.get(lambda s: s.running)
        assert supervisor.restarts("consensus") >= 1
        assert etcd_pid(service.config.ephemeral) not in (None, old_pid)
        kv = await restarted.curator_client().get("survivor")
        assert kv is not None and kv.value == b"yes"
        assert restarted.member_id == status.member_id


async def test_a_removed_member_whose_etcd_exits_is_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd leaves by itself (status 0) once its member is removed: the service
    says so in one WARNING and waits for its owner, logging no ERROR and not
    starting etcd again on the stale data."""
    caplog.set_level(logging.INFO)
    n1, n2 = Machine.make(tmp_path / "n1"), Machine.make(tmp_path / "n2")
    # Without etcd's health wait the removal lands at once, while n2's
    # children may still make their first calls (etcd refusing it for its
    # health window is what test_revoke_leader.py's two-member test meets).
    n1.health_wait = n2.health_wait = False
    async with trio.open_nursery() as nursery:
        first = await start(nursery, n1)
        join = await first.status.add_node(n2.public_key, peer_url=n2.peer_url)
        async with running(n2, join) as (service, supervisor, _):
            assert etcd_pid(n2.root.ephemeral.consensus) is not None
            await first.status.remove_node(n2.public_key)
            with trio.fail_after(BOUND):
                await eventually(
                    # The service's own words: etcd logs "... because it was
                    # removed" too, about its peers, before it is done.
                    lambda: any("this member was removed" in r.getMessage() for r in caplog.records)
                )
            assert etcd_pid(n2.root.ephemeral.consensus) is None
            with service.status.watch() as watcher:
                assert not (await watcher.get()).running
            assert supervisor.restarts("consensus") == 0
            # One start on each node: n2's etcd was not started again.
            starts = [r for r in caplog.records if r.getMessage().startswith("starting etcd:")]
            assert len(starts) == 2
        await first.stop()
    # etcd itself may panic instead of exiting cleanly when a request (the
    # promoter's status call) races its removal (etcd-io/etcd#21966): its
    # own CRITICAL line is etcd's; the service must log no error of its own.
    errors = [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and not r.getMessage().startswith(REMOVAL_PANIC)
    ]
    assert not errors, [r.getMessage() for r in errors]


async def test_children_end_before_the_etcd_client_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # promoter and crl borrow the service's etcd client: they must have ended
    # whenever it is closed, both when etcd dies and when the service stops.
    from metropolis.consensus import service as service_module

    live: set[str] = set()
    at_close: list[set[str]] = []

    def tracked(name: str, fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def wrapper(*args: object) -> None:
            live.add(name)
            try:
                await fn(*args)
            finally:
                live.discard(name)

        return wrapper

    original_aclose = Client.aclose

    async def recording_aclose(self: Client) -> None:
        at_close.append(set(live))
        await original_aclose(self)

    from metropolis.consensus import crlsync, promoter

    # Patched where the service looks them up (it imports them by name).
    monkeypatch.setattr(service_module, "run_promoter", tracked("promoter", promoter.run_promoter))
    monkeypatch.setattr(service_module, "sync_crl", tracked("crl", crlsync.sync_crl))
    monkeypatch.setattr(Client, "aclose", recording_aclose)

    machine = Machine.make(tmp_path / "n1")
    async with running(machine) as (service, supervisor, _):
        with trio.fail_after(BOUND):
            await supervisor.wait_healthy("consensus.crl")
            await supervisor.wait_healthy("consensus.promoter")
        assert live == {"promoter", "crl"}
        kill_etcd(service.config.ephemeral)
        with trio.fail_after(BOUND), service.status.watch() as watcher:
            await watcher.get(lambda s: not s.running)
            await watcher.get(lambda s: s.running)
            await supervisor.wait_healthy("consensus.crl")
    assert not live
    # Bootstrap's client, the first run's (etcd killed), the second run's.
    assert len(at_close) >= 3
    assert at_close == [set()] * len(at_close)


@dataclass
class Started:
    """A node running in the background; ``stop()`` takes it down for good."""

    service: Service
    status: Status
    scope: trio.CancelScope
    stopped: trio.Event

    async def stop(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()


async def start(
    nursery: trio.Nursery, machine: Machine, join: JoinCluster | None = None
) -> Started:
    async def run(*, task_status: trio.TaskStatus[Started]) -> None:
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with running(machine, join) as (service, _, status):
                    task_status.started(Started(service, status, scope, stopped))
                    await trio.sleep_forever()
        finally:
            stopped.set()

    started: Started = await nursery.start(run)
    return started


async def test_a_learner_is_promoted_without_waiting_for_the_poll(tmp_path: Path) -> None:
    """The promoter looks when a learner is added (nudged; the peer certificate
    is watched), and retries at heartbeat pace while it catches up: never the
    hour-long poll interval set here."""
    n1, n2 = Machine.make(tmp_path / "n1"), Machine.make(tmp_path / "n2")
    n1.promote_interval = 3600
    async with trio.open_nursery() as nursery:
        first = await start(nursery, n1)
        join = await first.status.add_node(n2.public_key, peer_url=n2.peer_url)
        # running() waits for n2's status to say running: a voter, promoted.
        second = await start(nursery, n2, join)
        # n2 saw itself promoted in what it applied; the leader applies the
        # same committed change on its own schedule, which under load can
        # come a moment later.
        async with Client(first.service.config.client_socket) as c1:
            polls = Retrier(ExponentialBackoff(initial=0.05, maximum=0.5))
            with trio.fail_after(BOUND):
                while any(m.is_learner for m in await c1.member_list()):
                    await polls.sleep()
        await second.stop()
        await first.stop()


async def test_serializable_reads_answer_from_the_members_own_state(tmp_path: Path) -> None:
    """A member cut off from its quorum still answers serializable reads (and a
    transaction of serializable gets) from what it applied; a linearizable
    read, which asks the leader first, gets no answer."""
    n1, n2 = Machine.make(tmp_path / "n1"), Machine.make(tmp_path / "n2")
    async with trio.open_nursery() as nursery:
        first = await start(nursery, n1)
        join = await first.status.add_node(n2.public_key, peer_url=n2.peer_url)
        second = await start(nursery, n2, join)
        async with (
            Client(first.service.config.client_socket) as c1,
            Client(second.service.config.client_socket) as c2,
        ):
            await c1.put("k", "v")
            assert (await c2.range("k")).kvs[0].value == b"v"  # applied on n2 too
            await first.stop()  # n2 alone: one voter of two, no quorum
            with trio.fail_after(BOUND):
                alone = await c2.range("k", serializable=True)
                txn = await c2.txn([], [Get("k", serializable=True), Get("x", serializable=True)])
            assert alone.kvs[0].value == b"v"
            found, missing = (r for r in txn.responses if isinstance(r, RangeResult))
            assert found.kvs[0].value == b"v" and not missing.kvs
            with trio.move_on_after(1) as waiting:
                await c2.range("k")
            assert waiting.cancelled_caught
            with trio.move_on_after(1) as waiting:
                await c2.txn([], [Get("k", serializable=True), Get("x")])
            assert waiting.cancelled_caught
        nursery.cancel_scope.cancel()


async def test_three_nodes_join_replicate_and_survive_a_loss(tmp_path: Path) -> None:
    n1, n2, n3 = (Machine.make(tmp_path / f"n{i}") for i in (1, 2, 3))
    async with trio.open_nursery() as nursery:
        first = await start(nursery, n1)
        join2 = await first.status.add_node(n2.public_key, peer_url=n2.peer_url)
        assert [n.url for n in join2.existing_nodes] == [n1.peer_url]
        # Added as a non-voting learner: an unstarted voter would cost the quorum.
        async with Client(first.service.config.client_socket) as c1:
            [joiner] = [m for m in await c1.member_list() if n2.peer_url in m.peer_urls]
        assert joiner.is_learner
        second = await start(nursery, n2, join2)
        # etcd takes one learner at a time, so this also waits for n2's promotion.
        with trio.fail_after(BOUND):
            join3 = await first.status.add_node(n3.public_key, peer_url=n3.peer_url)
        assert {n.url for n in join3.existing_nodes} == {n1.peer_url, n2.peer_url}
        third = await start(nursery, n3, join3)

        async with (
            Client(second.service.config.client_socket) as c2,
            Client(third.service.config.client_socket) as c3,
        ):
            members = await c3.member_list()
            assert sorted(m.name for m in members) == sorted(
                s.status.node_id for s in (first, second, third)
            )
            assert not any(m.is_learner for m in members)

            await c3.put("written-on", "n3")
            kv = await c2.get("written-on")
            assert kv is not None and kv.value == b"n3"

            # Node 1, the bootstrapper, goes away for good.
            await first.stop()
            assert etcd_pid(n1.root.ephemeral.consensus) is None
            with trio.fail_after(BOUND):
                # Two of three voters: writes still commit, and are read elsewhere.
                await c2.put("after-loss", "ok")
                kv = await c3.get("after-loss")
            assert kv is not None and kv.value == b"ok"
            status = await c3.status()
            assert status.leader in {second.status.member_id, third.status.member_id}
        nursery.cancel_scope.cancel()


async def _peer_request(
    peer_url: str, ca: bytes, cert: bytes | None, key: bytes | None, tmp: Path
) -> int:
    """GET /version on a peer port with the given client credentials; the HTTP status."""
    context = ssl.create_default_context(cadata=ca.decode())
    if cert is not None and key is not None:
        (tmp / "cert.pem").write_bytes(cert)
        (tmp / "key.pem").write_bytes(key)
        context.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    async with httpx.AsyncClient(verify=context, timeout=5) as http:
        response = await http.get(f"{peer_url}/version")
        return response.status_code


async def test_revoked_peer_certificate_is_refused(tmp_path: Path) -> None:
    machine = Machine.make(tmp_path / "n1")
    outsider_key = pki.generate_key()
    outsider_pub = pki.public_key_bytes(outsider_key)
    creds = tmp_path / "outsider"
    creds.mkdir()
    async with running(machine) as (service, _, status):
        # A node we admitted: it holds a valid peer certificate.
        join = await status.add_node(
            outsider_pub, peer_url=f"https://127.0.0.1:{free_loopback_port()}"
        )
        ca_pem = pki.encode_certificate(join.ca_certificate)
        cert_pem = pki.encode_certificate(join.node_certificate)
        key_pem = pki.encode_private_key(outsider_key)
        with trio.fail_after(BOUND):
            assert await _peer_request(machine.peer_url, ca_pem, cert_pem, key_pem, creds) == 200
            # No certificate, or one from another CA (same name, other key): no way in.
            stranger_key = pki.generate_key()
            stranger_ca = pki.new_ca(stranger_key, peerpki.CA_NAME)
            stranger_cert = pki.issue_certificate(
                stranger_key,
                stranger_ca,
                stranger_key.public_key(),
                identity.node_id(stranger_key.public_key()),
                pki.Usage.PEER,
                ip_addresses=["127.0.0.1"],
            )
            for cert, key in [
                (None, None),
                (pki.encode_certificate(stranger_cert), pki.encode_private_key(stranger_key)),
            ]:
                with pytest.raises(httpx.TransportError):
                    await _peer_request(machine.peer_url, ca_pem, cert, key, creds)

        async with Client(service.config.client_socket) as client:
            assert len(await client.member_list()) == 2  # the outsider, as a learner
            with trio.fail_after(BOUND):
                crl = await status.remove_node(outsider_pub)
            assert pki.is_revoked(crl, join.node_certificate)
            assert len(await client.member_list()) == 1
        with pytest.raises(ValueError, match="itself"):
            await status.remove_node(machine.public_key)

        # remove_node wrote the new list at once; etcd reads it per connection.
        crl_path = service.config.data.peer_crl
        assert pki.is_revoked(pki.decode_crl(crl_path.read_bytes()), join.node_certificate)
        with trio.fail_after(BOUND):
            with pytest.raises(httpx.TransportError):
                await _peer_request(machine.peer_url, ca_pem, cert_pem, key_pem, creds)

        # The member itself is unaffected.
        async with Client(service.config.client_socket) as client:
            await client.put("still", "fine")


async def test_an_addition_and_a_removal_at_once_both_complete(tmp_path: Path) -> None:
    """raft drops a membership change proposed while another is pending, and
    etcd takes one learner at a time: whichever way the two race, both calls
    finish (a dropped change times out at etcd's deadline and is tried again,
    after looking whether it applied) and the membership is as asked."""
    machine = Machine.make(tmp_path / "n1")
    leaving, joining = (pki.public_key_bytes(pki.generate_key()) for _ in range(2))
    async with running(machine) as (_, _, status):
        await status.add_node(leaving, peer_url="https://127.0.0.2:2380")
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(status.remove_node, leaving)
                nursery.start_soon(
                    partial(status.add_node, joining, peer_url="https://127.0.0.3:2380")
                )
        urls = [u for m in await status.members() for u in m.peer_urls]
        assert "https://127.0.0.3:2380" in urls
        assert "https://127.0.0.2:2380" not in urls
        assert len(urls) == 2


@pytest.mark.parametrize("damage", ["foreign-cert", "partial-pki"])
async def test_inconsistent_setup_fails_clearly_and_writes_nothing(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = Machine.make(tmp_path / "good")
    other = Machine.make(tmp_path / "other")
    join: JoinCluster | None = None
    async with running(good) as (_, _, status):
        stolen = await status.add_node(good.public_key)
    if damage == "foreign-cert":
        # Join data for someone else's key: must not be accepted as ours.
        join = stolen
        expected = "not for this node's key"
    else:
        other.root.data.etcd.peer_pki.create()
        other.root.data.etcd.peer_pki.ca_certificate.write_bytes(b"lonely CA")
        expected = "partial peer PKI"

    before = sorted(p.relative_to(other.root.path) for p in other.root.path.rglob("*"))
    service = Service(other.config(join))
    async with open_supervisor(service.run, name="consensus") as supervisor:
        with trio.fail_after(BOUND):
            await supervisor.wait_state("consensus", State.BACKOFF)
    assert expected in caplog.text
    after = sorted(p.relative_to(other.root.path) for p in other.root.path.rglob("*"))
    assert after == before
    assert etcd_pid(other.root.ephemeral.consensus) is None


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("corrupt-key", "private key: not a valid private key"),
        ("mismatched-key", "private key does not match the node certificate"),
        ("wrong-ca", "node certificate does not chain to the CA"),
        ("another-node", "not this node"),
    ],
)
async def test_damaged_peer_credentials_fail_clearly_and_are_kept(
    tmp_path: Path, damage: str, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart on peer credentials that do not fit stops before etcd runs.

    etcd itself would run happily with a certificate from a foreign CA (only
    its peers would refuse it), so the service must check the files.
    """
    machine = Machine.make(tmp_path / "n1")
    async with running(machine):
        pass  # bootstrapped: etcd data, peer PKI and CRL on disk
    peer_pki = machine.root.data.etcd.peer_pki
    other_key = pki.generate_key()
    if damage == "corrupt-key":
        peer_pki.key.write_bytes(b"garbage")
    elif damage == "mismatched-key":
        peer_pki.key.write_bytes(pki.encode_private_key(other_key))
    elif damage == "wrong-ca":
        peer_pki.ca_certificate.write_bytes(
            pki.encode_certificate(pki.new_ca(other_key, peerpki.CA_NAME))
        )
    else:
        # Consistent credentials, but for a key that is not this node's.
        machine.key = other_key
    before = {p: p.read_bytes() for p in machine.root.path.rglob("*") if p.is_file()}

    service = Service(machine.config())
    async with open_supervisor(service.run, name="consensus") as supervisor:
        with trio.fail_after(BOUND):
            await supervisor.wait_state("consensus", State.BACKOFF)
    assert expected in caplog.text
    assert etcd_pid(machine.root.ephemeral.consensus) is None
    assert {p: p.read_bytes() for p in peer_pki.files()} == {p: before[p] for p in peer_pki.files()}


async def test_replayed_join_data_keeps_a_newer_crl(tmp_path: Path) -> None:
    """Join data comes again on every restart; it must not roll back revocations."""
    machine = Machine.make(tmp_path / "n")
    ca_key = pki.generate_key()
    ca = pki.new_ca(ca_key, peerpki.CA_NAME)
    cert = pki.issue_certificate(
        ca_key, ca, machine.key.public_key(), identity.node_id(machine.public_key), pki.Usage.PEER
    )
    initial = pki.new_crl(ca_key, ca)
    join = JoinCluster(ca, cert, initial, (ExistingNode("other", "https://127.0.0.1:1"),))
    service = Service(machine.config(join))
    crl_path = machine.root.data.etcd.peer_crl

    await service._write_join_pki(join)
    assert pki.decode_crl(crl_path.read_bytes()) == initial
    assert pki.decode_certificate(machine.root.data.etcd.peer_pki.certificate.read_bytes()) == cert

    # The CRL watcher wrote a newer list since: a replay keeps it.
    newer = pki.revoke(initial, ca_key, ca, [12345])
    crl_path.write_bytes(pki.encode_crl(newer))
    await service._write_join_pki(join)
    assert pki.decode_crl(crl_path.read_bytes()) == newer

    # A list from another CA on disk is no reason to keep anything.
    other_key = pki.generate_key()
    forged = pki.new_crl(other_key, pki.new_ca(other_key, peerpki.CA_NAME), number=99)
    crl_path.write_bytes(pki.encode_crl(forged))
    await service._write_join_pki(join)
    assert pki.decode_crl(crl_path.read_bytes()) == initial


async def test_crl_watcher_writes_only_lists_signed_by_the_peer_ca(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd does not check the CRL file's signature, so the watcher must."""
    machine = Machine.make(tmp_path / "n1")
    async with running(machine) as (service, _, _):
        crl_path = service.config.data.peer_crl
        genuine = crl_path.read_bytes()
        async with Client(service.config.client_socket) as client:
            pki_kv = client.namespaced(peerpki.NAMESPACE)
            other_key = pki.generate_key()
            forged = pki.new_crl(other_key, pki.new_ca(other_key, peerpki.CA_NAME), number=99)
            await pki_kv.put(peerpki.KEY_CRL, pki.encode_crl(forged, pki.Encoding.DER))
            with trio.fail_after(BOUND):
                await eventually(lambda: "ignoring bad CRL" in caplog.text)
            assert crl_path.read_bytes() == genuine

            # A genuine update after that still goes through.
            ca = await peerpki.load_ca(pki_kv)
            newer = pki.revoke(pki.decode_crl(genuine), ca.key, ca.certificate, [4242])
            await pki_kv.put(peerpki.KEY_CRL, pki.encode_crl(newer, pki.Encoding.DER))
            with trio.fail_after(BOUND):
                await eventually(lambda: pki.decode_crl(crl_path.read_bytes()) == newer)


def test_join_data_round_trips_through_the_node_role() -> None:
    ca_key = pki.generate_key()
    ca = pki.new_ca(ca_key, peerpki.CA_NAME)
    node_key = pki.generate_key()
    cert = pki.issue_certificate(ca_key, ca, node_key.public_key(), "n", pki.Usage.PEER)
    join = JoinCluster(
        ca,
        cert,
        pki.new_crl(ca_key, ca, [7]),
        (ExistingNode("a", "https://127.0.0.1:1"), ExistingNode("b", "https://127.0.0.1:2")),
    )
    role = join.to_proto()
    # Through the wire format, as the curator stores it in the node's roles.
    parsed = JoinCluster.from_proto(NodeRolesConsensusMember.parse(bytes(role)))
    assert parsed == join

    role.initial_crl = b"garbage"
    with pytest.raises(ConsensusError, match="initial CRL"):
        JoinCluster.from_proto(role)


async def test_a_restart_leaves_an_unchanged_crl_file_alone(tmp_path: Path) -> None:
    """The CRL watcher reads etcd's CRL at every start; when the file already
    holds it, it is not rewritten (an fsync less on the start path)."""
    machine = Machine.make(tmp_path / "n1")
    crl = machine.root.data.etcd.peer_crl
    async with running(machine) as (_, supervisor, _):
        with trio.fail_after(BOUND):
            await supervisor.wait_healthy("consensus.crl")
    inode = crl.stat().st_ino  # atomic_write replaces the file: a new inode
    async with running(machine) as (_, supervisor, _):
        with trio.fail_after(BOUND):
            await supervisor.wait_healthy("consensus.crl")
    assert crl.stat().st_ino == inode
