"""The role server in-process on real etcd: bootstrap from nothing, and the launcher.

The node's values are fed directly (as the curator's role fetch will), and
the tests watch etcd's pid to tell a restarted control plane from a kept one.
"""

from __future__ import annotations

import dataclasses
import logging
import stat
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from cryptography import x509

from metropolis import pki
from metropolis.consensus.client import Client
from metropolis.consensus.localetcd import etcd_pid
from metropolis.consensus.process import SOCKET_NAME
from metropolis.curator.bootstrap import cluster_ca, node_certificate
from metropolis.curator.election import Leader
from metropolis.identity import NodeCredentials, node_id
from metropolis.localstorage import Root
from metropolis.proto.common import (
    ClusterDirectory,
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesKubernetesController,
)
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve import disk
from metropolis.roleserve.loopback import loopback_settings, prepare_loopback_bootstrap
from metropolis.roleserve.server import RoleServer
from metropolis.roleserve.values import BootstrapData, ClusterMembership
from metropolis.supervisor import Supervisor, open_supervisor

BOUND = 90


def new_root(path: Path) -> tuple[Root, BootstrapData]:
    root = Root(path)
    return root, prepare_loopback_bootstrap(root)


def _local(m: ClusterMembership) -> bool:
    return m.home and m.local_consensus is not None and m.local_curator is not None


@asynccontextmanager
async def node(root: Root) -> AsyncIterator[tuple[RoleServer, Supervisor, ClusterMembership]]:
    # These tests feed roles in themselves: no role fetch from the curator.
    server = RoleServer(root, disk.load(root), fetch_roles=False)
    async with open_supervisor(server.run, name="role") as supervisor:
        with trio.fail_after(BOUND), server.membership.watch() as w:
            membership = await w.get(_local)
        yield server, supervisor, membership


async def _leader(membership: ClusterMembership) -> Leader:
    assert membership.local_curator is not None
    with membership.local_curator.election.watch() as w:
        state = await w.get(lambda s: isinstance(s, Leader))
    assert isinstance(state, Leader)
    return state


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_bootstrap_from_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, data = new_root(tmp_path / "n")
    caplog.set_level(logging.INFO)
    async with node(root) as (_, _, membership):
        with trio.fail_after(BOUND):
            await _leader(membership)
        me = node_id(data.node_public_key)
        assert membership.credentials is not None and membership.credentials.node_id == me

        # The node's first status push writes /heartbeats/<id>: the keys
        # are listed after it, not racing it.
        with trio.fail_after(BOUND):
            await _until(
                lambda: any(r.getMessage().startswith("status pushed") for r in caplog.records)
            )
        # The expected keys, each exactly once.
        async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
            keys = [kv.key for kv in (await etcd.range(b"", prefix=True)).kvs]
        curator = sorted(k for k in keys if k.startswith(b"namespaced/curator/"))
        assert curator == sorted(
            b"namespaced/curator/" + k
            for k in [
                b"/cluster-pki/ca/certificate",
                b"/cluster-pki/ca/key",
                b"/cluster-pki/issued/node-" + me.encode(),
                b"/global/initial_owner",
                b"/join_keys/" + data.join_public_key.hex().encode(),
                b"/heartbeats/" + me.encode(),
                b"/leader",
                b"/nodes/" + me.encode(),
            ]
        )
        assert len(keys) == len(set(keys))
        assert sum(k.startswith(b"namespaced/etcd-pki/ca/certificate") for k in keys) == 1

    # On disk, with the right modes, and parsing back.
    creds_dir = root.data.node_credentials
    for path in creds_dir.files():
        assert _mode(path) == 0o600, path
    assert _mode(creds_dir.path) == 0o700
    credentials = NodeCredentials.load(creds_dir)
    assert credentials.public_key == data.node_public_key
    directory = root.esp.read_cluster_directory()
    assert _mode(root.esp.cluster_directory) == 0o644
    assert [(n.public_key, [a.host for a in n.addresses]) for n in directory.nodes] == [
        (data.node_public_key, ["127.0.0.1"])
    ]
    sealed_path = root.esp.sealed_configuration.path
    assert _mode(sealed_path) == 0o600
    sealed = root.esp.sealed_configuration.unseal(insecure=True)
    assert sealed.node_unlock_key == data.node_unlock_key
    assert len(sealed.join_key) == 64 and sealed.join_key[32:] == data.join_public_key
    assert pki.decode_certificate(sealed.cluster_ca) == credentials.ca_certificate
    roles = disk.read_roles(root)
    assert roles.consensus_member is not None and roles.kubernetes_controller is not None
    assert not disk.bootstrap_path(root).exists()
    assert not disk.staged_credentials_path(root).path.exists()  # renamed into place
    # Consensus started etcd once, and the bootstrap ran once.
    starts = [r for r in caplog.records if r.getMessage().startswith("starting etcd:")]
    assert len(starts) == 1
    # The files written while etcd created the cluster were the right ones:
    # no second round to write etcd's version of them.
    assert not any("earlier attempt" in r.getMessage() for r in caplog.records)
    # The cluster was created beside the PKI store, before consensus ran:
    # never on the slower path that asks etcd for the join data first.
    messages = [r.getMessage() for r in caplog.records]
    assert "bootstrapping: cluster created in etcd; saving credentials" in messages
    assert "bootstrapping: creating the cluster" not in messages
    assert etcd_pid(root.ephemeral.consensus) is None


async def test_bootstrap_stages_its_credentials_while_etcd_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By the time the cluster exists, the credentials are staged: only a rename is left."""
    root, _ = new_root(tmp_path / "n")
    staged_at_commit: list[x509.Certificate | None] = []
    committed: list[x509.Certificate] = []
    commit = disk.save_credentials

    def watched_commit(r: Root, credentials: NodeCredentials) -> None:
        staged = disk.staged_credentials_path(r)
        if staged.all_present():
            staged_at_commit.append(NodeCredentials.load(staged).certificate)
        else:
            staged_at_commit.append(None)
        committed.append(credentials.certificate)
        commit(r, credentials)

    monkeypatch.setattr(disk, "save_credentials", watched_commit)
    async with node(root) as (_, _, membership):
        # Home means committed: the credentials are in place, nothing staged.
        assert membership.credentials is not None
        assert NodeCredentials.load(root.data.node_credentials).certificate == (
            membership.credentials.certificate
        )
        assert not disk.staged_credentials_path(root).path.exists()
    assert staged_at_commit == committed and len(committed) == 1


def _credentials() -> NodeCredentials:
    """A node's credentials in a new cluster, as a bootstrap makes them."""
    ca_key, ca = cluster_ca()
    key = pki.generate_key()
    return NodeCredentials(key, node_certificate(ca_key, ca, pki.public_key_bytes(key)), ca)


def _stage(root: Root, credentials: NodeCredentials) -> None:
    disk.save_cluster_files(
        root,
        disk.NodeSettings(address="127.0.0.1", insecure_seal=True),
        roles=NodeRoles(),
        directory=ClusterDirectory(),
        sealed=SealedConfiguration(),
        staged_credentials=credentials,
    )


def test_staged_credentials_mean_nothing_until_committed(tmp_path: Path) -> None:
    root, _ = new_root(tmp_path / "n")
    credentials = _credentials()
    _stage(root, credentials)
    staged = disk.staged_credentials_path(root)
    assert _mode(staged.path) == 0o700 and all(_mode(p) == 0o600 for p in staged.files())
    # A crash now: the node resumes its bootstrap.
    saved = disk.load(root)
    assert saved.credentials is None and saved.bootstrap is not None

    disk.save_credentials(root, credentials)
    saved = disk.load(root)
    assert saved.credentials is not None and saved.bootstrap is None
    assert saved.credentials.certificate == credentials.certificate
    assert not staged.path.exists()
    assert _mode(root.data.node_credentials.path) == 0o700
    assert not disk.bootstrap_path(root).exists()


def test_commit_stages_credentials_other_than_the_staged_ones(tmp_path: Path) -> None:
    """Another attempt's cluster won: its credentials are committed, not the staged ones."""
    root, _ = new_root(tmp_path / "n")
    _stage(root, _credentials())
    winner = _credentials()
    disk.save_credentials(root, winner)
    saved = disk.load(root).credentials
    assert saved is not None and saved.certificate == winner.certificate
    assert saved.ca_certificate == winner.ca_certificate


def test_commit_replaces_the_leftovers_of_an_unfinished_save(tmp_path: Path) -> None:
    root, _ = new_root(tmp_path / "n")
    credentials = _credentials()
    final = root.data.node_credentials
    final.ca_certificate.write_bytes(b"half of an earlier save")
    (final.path / ".cert.pem.x.tmp").write_bytes(b"")
    _stage(root, credentials)
    disk.save_credentials(root, credentials)
    loaded = NodeCredentials.load(final)
    assert loaded.certificate == credentials.certificate
    assert sorted(p.name for p in final.path.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]


async def _until(predicate: Callable[[], bool]) -> None:
    while True:
        if predicate():
            return
        await trio.sleep(0.05)


async def test_launcher_restarts_only_when_the_control_plane_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, _ = new_root(tmp_path / "n")
    caplog.set_level(logging.INFO)
    launcher = "role.controlplane.launcher"
    async with node(root) as (server, supervisor, membership):
        pid = etcd_pid(root.ephemeral.consensus)
        assert pid is not None
        with server.roles.watch() as w:
            roles = await w.get()
        assert roles.consensus_member is not None

        def restarts() -> int:
            return next(i.restarts for i in supervisor.snapshot() if i.name == launcher)

        with trio.fail_after(BOUND):
            # KubernetesController off and on, membership churn: nothing restarts.
            server.roles.set(NodeRoles(consensus_member=roles.consensus_member))
            server.membership.set(
                ClusterMembership(
                    membership.public_key,
                    membership.credentials,
                    membership.remote_curators,
                    membership.local_consensus,
                    membership.local_curator,
                )
            )
            server.roles.set(roles)
            # Corrupt join data: logged and skipped. Messages are handled in
            # order, so once it is logged everything before was handled too.
            bad = NodeRolesConsensusMember(ca_certificate=b"junk", peer_certificate=b"junk")
            server.roles.set(NodeRoles(consensus_member=bad))
            await _until(lambda: any("role skipped" in r.getMessage() for r in caplog.records))
            assert etcd_pid(root.ephemeral.consensus) == pid
            assert restarts() == 0

            # Without ConsensusMember: consensus and curator stop.
            server.roles.set(NodeRoles(kubernetes_controller=NodeRolesKubernetesController()))
            with server.membership.watch() as mw:
                await mw.get(lambda m: m.home and m.local_consensus is None)
            await _until(lambda: etcd_pid(root.ephemeral.consensus) is None)
            assert restarts() == 1
            assert disk.load(root).roles == NodeRoles(
                kubernetes_controller=NodeRolesKubernetesController()
            )

            # A node that is no member wipes etcd's data: a grant later joins
            # fresh (tests/metropolis/test_cluster.py). A sole member never
            # gets here through the curator, which keeps the last voter.
            # (Wiped, then the empty layout made again.)
            etcd = root.data.etcd
            await _until(lambda: not etcd.data.exists() and etcd.peer_pki.path.is_dir())
        info = next(i for i in supervisor.snapshot() if i.name == launcher)
        assert info.last_error is None  # restarts on request, never failures


async def test_restart_from_disk_logs_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node stopped and started again in one process: role fetch, status push
    and directory update find its own curator at once, so nothing fails on the
    way (no ERROR logged).

    Its directory names the node itself; calling that address before the
    node's curator serves again used to fail both runnables once per start.
    """
    root, _ = new_root(tmp_path / "n")
    caplog.set_level(logging.INFO)
    for _ in range(2):  # bootstrap, then run from what it left
        server = RoleServer(root, disk.load(root))
        async with open_supervisor(server.run, name="role") as supervisor:
            with trio.fail_after(BOUND):
                await supervisor.wait_healthy("role.rolefetch")
                await supervisor.wait_healthy("role.statuspush")
                await supervisor.wait_healthy("role.directory")
        assert etcd_pid(root.ephemeral.consensus) is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_saving_the_roles_a_node_has_already_writes_nothing(tmp_path: Path) -> None:
    """Roles come back as a node comes home; rewriting them cost an fsync at that moment."""
    root = Root(tmp_path / "n")
    root.create()
    (root.data.path / "node").mkdir(exist_ok=True)
    roles = NodeRoles(kubernetes_controller=NodeRolesKubernetesController())
    disk.save_roles(root, roles)
    written = disk.roles_path(root).stat().st_ino
    disk.save_roles(root, roles)
    assert disk.roles_path(root).stat().st_ino == written  # atomic_write makes a new inode
    disk.save_roles(root, NodeRoles())
    assert disk.roles_path(root).stat().st_ino != written
    assert disk.read_roles(root) == NodeRoles()


@pytest.mark.parametrize("wait", [True, False])
def test_the_member_health_wait_is_a_saved_setting(tmp_path: Path, wait: bool) -> None:
    root = Root(tmp_path / "n")
    root.create()
    settings = loopback_settings()
    settings = dataclasses.replace(
        settings, tuning=dataclasses.replace(settings.tuning, member_health_wait=wait)
    )
    prepare_loopback_bootstrap(root, settings=settings)
    assert disk.load(root).settings == settings
