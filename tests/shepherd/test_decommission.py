"""Decommissioning end to end: the operator asks (``python -m bmdb
decommission``), the real decommissioner has the real agent wipe a machine
taken over by the real initializer (over a real sshd), the provider releases
it (the local Equinix API deletes the device; a static machine is marked
removed), and the tombstone is never offered to any process again."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Process, Provider, Queries, WorkEvent
from common.backoff import ExponentialBackoff
from metropolis import pki
from metropolis.owner import OwnerAccess
from metropolis.rpc import Endpoint
from shepherd.control_loop import LoopStats
from shepherd.decommissioner import Decommissioner
from shepherd.initializer import Initializer
from shepherd.localsshd import Sshd
from shepherd.providers import Machine
from shepherd.providers.equinix.client import EquinixClient
from shepherd.providers.equinix.localserver import LocalEquinix
from shepherd.providers.equinix.provider import EquinixConfig, EquinixProvider
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import Provisioner
from shepherd.recoverer import Recoverer
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.bmdb.test_cli import cli
from tests.shepherd.helpers import agent_keys, events, host_key_of
from tests.shepherd.test_initializer import agent_config
from tests.shepherd.test_operator_actions import run_until

PREFIX = "shepherd-test-"


class SshdEquinix(EquinixProvider):
    """The local Equinix API's devices, each dialed at the test's sshd."""

    def __init__(
        self, sshd: Sshd, client: EquinixClient, config: EquinixConfig, ssh_key: str
    ) -> None:
        super().__init__(client, config, ssh_key)
        self.sshd = sshd

    async def get_machine(self, machine_id: str) -> Machine:
        machine = await super().get_machine(machine_id)
        return dataclasses.replace(machine, address=self.sshd.host, port=self.sshd.port)


@pytest.fixture
async def equinix_client(equinix: LocalEquinix) -> AsyncIterator[EquinixClient]:
    async with EquinixClient(equinix.token, base_url=equinix.url) as client:
        yield client


async def _failure(conn: bmdb.Connection, decommissioner: Decommissioner, mid: uuid.UUID) -> str:
    """Run ``decommissioner`` until the machine's decommission history has
    its second event (Started, then how it ended); that one is a failure:
    its cause."""

    async def ended(stats: LoopStats) -> bool:
        return len(await events(conn, mid, Process.SHEPHERD_DECOMMISSION)) >= 2

    await run_until(conn, decommissioner, ended)
    [_, (event, cause)] = await events(conn, mid, Process.SHEPHERD_DECOMMISSION)
    assert event == WorkEvent.FAILED, cause
    return cause


def _fake_install(sshd: Sshd) -> tuple[Path, subprocess.Popen[bytes]]:
    """What an install leaves on the loopback disk, with a "node" running
    from its image (a process whose command line names the image, as the
    agent's install starts it)."""
    disk = sshd.root / "disks" / "disk0"
    (disk / "metropolis").mkdir(parents=True)
    (disk / "metropolis" / "node.key").write_bytes(b"secret")
    image = disk / "image.pyz"
    image.write_bytes(b"not really an image")
    (disk / "node-parameters.pb").write_bytes(b"parameters")
    node = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", str(image)],
        start_new_session=True,
    )
    (disk / "node.pid").write_text(f"{node.pid}\n")
    (sshd.root / "agent.install.json").write_text("{}")
    return disk, node


@pytest.mark.parametrize("kind", ["static", "equinix"])
async def test_decommission_end_to_end(
    kind: str,
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
    equinix: LocalEquinix,
    equinix_client: EquinixClient,
) -> None:
    provider: StaticProvider | EquinixProvider
    if kind == "static":
        provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
        provider_id = "m-1"
    else:
        config = EquinixConfig(equinix.project_id, "shepherd-test", PREFIX)
        provider = SshdEquinix(sshd, equinix_client, config, shepherd_ssh_key.authorized_key)
        provider_id = equinix.add_device(f"{PREFIX}1")["id"]

    async def add(q: Queries) -> None:
        mid = await q.new_machine()
        await q.add_provided(mid, provider.type, provider_id, address="ignored")

    await bmdb_conn.transact(add)
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    target = sshd.root / "agent"
    initializer = Initializer(provider, ssh, agent_config(target, _agent()))

    async def taken_over(stats: LoopStats) -> bool:
        return bool(await agent_keys(bmdb_conn))

    await run_until(bmdb_conn, initializer, taken_over)
    [mid] = await agent_keys(bmdb_conn)
    assert await host_key_of(bmdb_conn, mid) == sshd.host_key
    assert (sshd.root / "agent.key").exists()
    disk, node = _fake_install(sshd)
    try:
        code, out, err = await cli(
            "--url", bmdb_url, "decommission", str(mid), "--reason", "end of lease"
        )
        assert (code, err) == (0, ""), err
        assert "decommission requested" in out
        decommissioner = Decommissioner(provider, ssh, agent_target_path=str(target))

        async def decommissioned(stats: LoopStats) -> bool:
            return any(
                e == WorkEvent.FINISHED
                for e, _ in await events(bmdb_conn, mid, Process.SHEPHERD_DECOMMISSION)
            )

        await run_until(bmdb_conn, decommissioner, decommissioned)
        # The "node" was stopped and the disk emptied; the agent's key is gone.
        with trio.fail_after(10):
            await trio.to_thread.run_sync(node.wait)
        assert disk.is_dir() and list(disk.iterdir()) == []
        assert not (sshd.root / "agent.key").exists()
        assert not (sshd.root / "agent.install.json").exists()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    # The provider released it.
    if kind == "equinix":
        assert provider_id not in equinix.devices
    assert await events(bmdb_conn, mid, Process.SHEPHERD_DECOMMISSION) == [
        (WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")
    ]  # fmt: skip
    code, out, _ = await cli("--url", bmdb_url, "machines")
    header, row = out.splitlines()
    assert row.split()[header.split().index("HELD")] == "decommission:decommissioned"
    code, out, _ = await cli("--url", bmdb_url, "machine", str(mid))
    line = next(x for x in out.splitlines() if x.startswith("decommission:"))
    assert "decommissioned (a tombstone)" in line and "stopped 1 process(es)" in line
    assert str(disk / "image.pyz") in line
    assert ("deleted" if kind == "equinix" else "marked removed") in line
    # The tombstone keeps its history (the takeover, the decommission).
    history = await events(bmdb_conn, mid)
    assert history == [(WorkEvent.STARTED, ""), (WorkEvent.FINISHED, "")]
    code, out, _ = await cli("--url", bmdb_url, "audit", "--json")
    assert [r["action"] for r in json.loads(out)] == ["decommission"]

    # Never offered to any process again: not for a takeover (its agent tag
    # is gone), not for recovery, not to a second decommission.
    assert await agent_keys(bmdb_conn) == {}

    async def idle(stats: LoopStats) -> bool:
        return stats.iterations[initializer.component, "nothing"] >= 10

    await run_until(bmdb_conn, initializer, idle)
    assert await events(bmdb_conn, mid) == history
    recoverer = Recoverer(provider, first_heartbeat_timeout=0.001, heartbeat_timeout=0.001)

    async def recoverer_idle(stats: LoopStats) -> bool:
        return stats.iterations[recoverer.component, "nothing"] >= 10

    await run_until(bmdb_conn, recoverer, recoverer_idle)
    assert await events(bmdb_conn, mid, Process.SHEPHERD_RECOVERY) == []
    code, _, err = await cli("--url", bmdb_url, "decommission", str(mid), "--reason", "again")
    assert code == 1 and "decommission decommissioned at" in err
    # The provisioner neither re-adds the machine (the static file still
    # lists it) nor counts the deleted device as missing.
    result = await Provisioner(provider).reconcile(bmdb_conn)
    assert (result.managed, result.added, result.missing_in_provider) == (0, [], [])
    assert not result.refused

    async def machines(q: Queries) -> int:
        return len(await q.provided_by_provider(Provider(provider.type)))

    assert await bmdb_conn.transact(machines) == 1


def _agent() -> bytes:
    from shepherd.agent_bundle import agent_zipapp

    return agent_zipapp()


async def test_no_release_before_a_wipe_is_reported(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    shepherd_ssh_key: SSHKey,
    equinix: LocalEquinix,
    equinix_client: EquinixClient,
) -> None:
    """A machine whose wipe cannot run (no pinned host key: it never proved
    who it is) fails with its cause and a backoff; its device is not deleted
    and it is no tombstone."""
    config = EquinixConfig(equinix.project_id, "shepherd-test", PREFIX)
    provider = EquinixProvider(equinix_client, config, shepherd_ssh_key.authorized_key)
    device = equinix.add_device(f"{PREFIX}1")["id"]

    async def add(q: Queries) -> bmdb.model.MachineProvided:
        mid = await q.new_machine()
        await q.add_provided(mid, provider.type, device)
        return (await q.provided_by_provider(provider.type))[0]

    mid = (await bmdb_conn.transact(add)).machine_id
    code, _, err = await cli("--url", bmdb_url, "decommission", str(mid), "--reason", "retire")
    assert (code, err) == (0, ""), err
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    decommissioner = Decommissioner(provider, ssh, agent_target_path="/root/agent")

    cause = await _failure(bmdb_conn, decommissioner, mid)
    assert "no pinned SSH host key" in cause
    assert device in equinix.devices
    code, out, _ = await cli("--url", bmdb_url, "machine", str(mid))
    assert "not wiped yet" in out and "BACKOFF" in out and "ShepherdDecommission" in out

    async def stamps(q: Queries) -> list[object]:
        rows = await q.execute(
            "SELECT wiped_at, released_at, decommissioned_at FROM machine_decommission"
        )
        return list(rows[0])

    assert await bmdb_conn.transact(stamps) == [None, None, None]
    # And the BMDB itself refuses a release recorded before the wipe.
    with pytest.raises(bmdb.errors.BMDBError, match="check"):

        async def release_first(q: Queries) -> None:
            await q.record_release(mid, "deleted")

        await bmdb_conn.transact(release_first)


async def _static_machine_taken_over(
    bmdb_conn: bmdb.Connection, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> tuple[StaticProvider, SSHClient, Path, uuid.UUID]:
    """A static machine (the test's sshd) taken over by the real
    initializer: its provider, the SSH client, the agent's path, its id."""
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])

    async def add(q: Queries) -> None:
        mid = await q.new_machine()
        await q.add_provided(mid, provider.type, "m-1", address="ignored")

    await bmdb_conn.transact(add)
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    target = sshd.root / "agent"
    initializer = Initializer(provider, ssh, agent_config(target, _agent()))

    async def taken_over(stats: LoopStats) -> bool:
        return bool(await agent_keys(bmdb_conn))

    await run_until(bmdb_conn, initializer, taken_over)
    [mid] = await agent_keys(bmdb_conn)
    return provider, ssh, target, mid


async def test_a_cluster_node_is_not_wiped_without_owner_credentials(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
) -> None:
    """A machine whose current successful install report names a node is a
    cluster node: without the owner's credentials the decommissioner cannot
    remove it from the cluster, so it wipes nothing and says why."""
    provider, ssh, target, mid = await _static_machine_taken_over(bmdb_conn, sshd, shepherd_ssh_key)
    key = bytes(range(32))

    async def installed(q: Queries) -> None:
        await q.set_os_installation_request(mid, 1, b"request")
        await q.record_os_installation_report(mid, 1, b"report", True, None, key)

    await bmdb_conn.transact(installed)
    disk, node = _fake_install(sshd)
    try:
        code, _, err = await cli("--url", bmdb_url, "decommission", str(mid), "--reason", "retire")
        assert (code, err) == (0, ""), err
        decommissioner = Decommissioner(provider, ssh, agent_target_path=str(target))

        cause = await _failure(bmdb_conn, decommissioner, mid)
        node_name = bmdb.model.node_id(key)
        assert f"is cluster node {node_name}; no owner credentials to remove it" in cause
        # Nothing was wiped: the node runs, the disk and the agent's key are there.
        assert node.poll() is None
        assert (disk / "image.pyz").exists() and (sshd.root / "agent.key").exists()
        code, out, _ = await cli("--url", bmdb_url, "machine", str(mid))
        assert "not wiped yet" in out and "no owner credentials" in out
    finally:
        node.kill()
        node.wait()


async def test_a_failing_node_removal_is_retried_then_shown_and_nothing_is_wiped(
    bmdb_conn: bmdb.Connection, bmdb_url: str, shepherd_ssh_key: SSHKey
) -> None:
    """Curators that do not answer: the removal is tried ``remove_attempts``
    times (waiting through common.backoff), then the work fails with the
    cause, which the views show; the wipe is not tried (its own failure
    would say "no pinned SSH host key")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    ca_key = pki.generate_key()
    access = OwnerAccess(
        [Endpoint("127.0.0.1", closed)], pki.new_ca(ca_key, "test CA"), pki.generate_key()
    )
    provider = StaticProvider([Machine("m-1", "127.0.0.1", 22)])
    key = bytes(range(32))

    async def add(q: Queries) -> bmdb.model.MachineProvided:
        mid = await q.new_machine()
        await q.add_provided(mid, provider.type, "m-1")
        await q.set_os_installation_request(mid, 1, b"request")
        await q.record_os_installation_report(mid, 1, b"report", True, None, key)
        return (await q.provided_by_provider(provider.type))[0]

    mid = (await bmdb_conn.transact(add)).machine_id
    code, _, err = await cli("--url", bmdb_url, "decommission", str(mid), "--reason", "retire")
    assert (code, err) == (0, ""), err
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    decommissioner = Decommissioner(
        provider,
        ssh,
        agent_target_path="/root/agent",
        owner=access,
        remove_attempts=3,
        remove_backoff=ExponentialBackoff(initial=0.01, maximum=0.02),
    )

    cause = await _failure(bmdb_conn, decommissioner, mid)
    assert f"is cluster node {bmdb.model.node_id(key)}; removing it failed 3 time(s)" in cause
    code, out, _ = await cli("--url", bmdb_url, "machine", str(mid))
    assert "removing it failed" in out and "not wiped yet" in out and "BACKOFF" in out

    async def stamps(q: Queries) -> list[object]:
        rows = await q.execute("SELECT node_removed_at, wiped_at FROM machine_decommission")
        return list(rows[0])

    assert await bmdb_conn.transact(stamps) == [None, None]


async def test_a_node_whose_install_report_comes_during_the_decommission_is_removed_before_release(
    aio_loop: object,
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
) -> None:
    """The source read no install report, then the agent stored one (its
    node registered) before the wipe stopped that node: once wiped, the
    decommissioner looks again and removes the node before the release.
    Without owner credentials it can only say so: wiped, not released."""
    provider, ssh, target, mid = await _static_machine_taken_over(bmdb_conn, sshd, shepherd_ssh_key)
    key = bytes(range(32))

    class ReportDuringTheWipe(Decommissioner):
        """The agent's report lands after the source, before the wipe."""

        async def _wipe(self, mid: uuid.UUID, provider_id: str, host_key: bytes | None) -> str:
            async def installed(q: Queries) -> None:
                await q.set_os_installation_request(mid, 1, b"request")
                await q.record_os_installation_report(mid, 1, b"report", True, None, key)

            await bmdb_conn.transact(installed)
            return await super()._wipe(mid, provider_id, host_key)

    disk, node = _fake_install(sshd)
    try:
        code, _, err = await cli("--url", bmdb_url, "decommission", str(mid), "--reason", "retire")
        assert (code, err) == (0, ""), err
        decommissioner = ReportDuringTheWipe(provider, ssh, agent_target_path=str(target))

        cause = await _failure(bmdb_conn, decommissioner, mid)
        node_name = bmdb.model.node_id(key)
        assert f"is cluster node {node_name}; no owner credentials to remove it" in cause

        async def stamps(q: Queries) -> list[object]:
            rows = await q.execute(
                "SELECT wiped_at IS NOT NULL, released_at, node_removed_at"
                " FROM machine_decommission"
            )
            return list(rows[0])

        assert await bmdb_conn.transact(stamps) == [True, None, None]
        assert list(disk.iterdir()) == []  # the wipe ran
        # Once its removal is recorded, the node is not looked for again.
        assert await bmdb_conn.transact(lambda q: q.unremoved_node_key(mid)) == key
        await bmdb_conn.transact(lambda q: q.record_node_removal(mid, node_name, "removed"))
        assert await bmdb_conn.transact(lambda q: q.unremoved_node_key(mid)) is None
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
