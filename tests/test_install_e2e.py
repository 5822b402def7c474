"""The whole installation flow, real everything: three taken-over machines become nodes.

PostgreSQL holds the BMDB; three loopback machines (`shepherd.localfleet`,
127.0.0.2-4) are taken over by the real initializer (the control loop, SSH,
the uploaded agent), whose agents heartbeat to the real agent callback
server; its image server serves the node image this test session built.
A first node bootstraps the cluster on 127.0.1.1 (its own address: the
fleet's machines run their nodes on 127.0.0.N, on the nodes' fixed
ports). ``python -m shepherd install`` asks the three agents to install;
each downloads and verifies the image, starts its node, which registers;
the Shepherd's approver approves exactly those nodes. Then: four nodes UP
and healthy, each machine installed with its node's id, a granted
ConsensusMember votes in etcd, and a node outlives its agent's SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio_asyncio

import bmdb
from bmdb.model import InstallState, OSInstallation, Queries, node_id
from metropolis import pki
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.localstorage import Root
from metropolis.owner import NodeRow, load_owner
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.agent_server.server import port_of
from shepherd.agent_start import AgentConfig
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.demo import write_machines_file
from shepherd.initializer import Initializer
from shepherd.localfleet import DISK, agent_pid, node_pid, open_fleet
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.metropolis.test_node_cli import LEADS, node
from tests.shepherd.agents import kill_agent

#: The bootstrap node's address: not 127.0.0.1 (the Shepherd's servers) nor
#: a fleet machine's 127.0.0.N; on the nodes' default ports, as the
#: installed nodes are.
FIRST = "127.0.1.1"
BOUND = 50.0


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    # Polling: the state lives in other processes and the BMDB.
    while not await check():  # noqa: ASYNC110
        await trio.sleep(0.2)


async def _cli(*argv: str) -> str:
    result = await trio.run_process(
        [sys.executable, "-m", *argv], capture_stdout=True, capture_stderr=True, check=False
    )
    assert result.returncode == 0, (argv, result.stdout, result.stderr)
    return result.stdout.decode()


def _processes_under(folder: Path) -> list[str]:
    """Command lines of running processes that name a path under ``folder``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path("/proc", pid, "cmdline").read_bytes()
        except OSError:
            continue
        if str(folder).encode() in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary folder with a short path: a node's etcd socket lies deep
    inside a machine's disk folder, and a UNIX socket path has at most 107
    bytes (pytest's ``tmp_path`` is too long for it)."""
    path = Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_three_taken_over_machines_become_approved_healthy_nodes(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers, the SSH client
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    root = Root(short_tmp / "n1")
    disks: list[Path] = []
    owner_key = short_tmp / "owner.pem"
    try:
        with trio.fail_after(BOUND):
            async with (
                open_fleet(
                    short_tmp / "fleet", count=3, authorized_key=shepherd_ssh_key.authorized_key
                ) as fleet,
                bmdb.open_connection(bmdb_url) as conn,
                trio.open_nursery() as nursery,
            ):
                machines = fleet.machines
                assert [m.host for m in machines] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
                for machine in machines:
                    (machine.root / "root").mkdir(exist_ok=True)
                    disks.append(machine.root / DISK)
                machines_file = short_tmp / "machines.toml"
                provider_ids = write_machines_file(machines_file, machines)
                provider = StaticProvider.from_file(machines_file)
                await sync_provided(conn, provider)

                images = await nursery.start(
                    serve_images, ImageServerConfig("127.0.0.1:0", node_image.parent)
                )
                binds = await nursery.start(
                    lambda task_status: run_agent_server(
                        conn, AgentServerConfig(listen="127.0.0.1:0"), task_status=task_status
                    )
                )
                config = AgentConfig(
                    executable=agent_zipapp(),
                    target_path="/root/agent",
                    endpoint=f"http://127.0.0.1:{port_of(binds[0])}",
                    endpoint_ca_certificate=b"",
                    ssh_connect_timeout=5.0,
                    ssh_exec_timeout=30.0,
                    heartbeat_interval=0.5,
                    heartbeat_backoff_cap=2.0,
                )
                ssh = SSHClient(
                    shepherd_ssh_key, username="root", connect_timeout=config.ssh_connect_timeout
                )
                start_control_loop(
                    nursery,
                    conn,
                    Initializer(provider, ssh, config),
                    parallelism=3,
                    limiter=RateLimiter(Rate(interval=0.01, burst=3)),
                )

                async with node(
                    "bootstrap",
                    *("--root", str(root.path), "--address", FIRST),
                    *("--owner-key-out", str(owner_key), "--insecure-seal"),
                    *("--status-interval", "1"),
                ) as first:
                    await first.wait_for(LEADS)
                    owner_cli: tuple[str, ...] = ("metropolis", "owner", "--root", str(root.path))
                    owner_cli += ("--owner-key", str(owner_key))
                    ticket = (await _cli(*owner_cli, "ticket")).strip()
                    cluster = short_tmp / "cluster.pb"
                    await _cli(*owner_cli, "info", "--out", str(cluster))

                    # Taken over: every agent heartbeats with its hardware report.
                    async def reported() -> bool:
                        rows = await conn.transact(lambda q: q.machines())
                        return len(rows) == 3 and all(r.has_hardware_report for r in rows)

                    await _until(reported)
                    ids = {
                        r.provided.provider_id: r.machine_id
                        for r in await conn.transact(lambda q: q.machines())
                        if r.provided is not None
                    }
                    digest = node_image.name.removesuffix(".pyz")
                    out = await _cli(
                        *("shepherd", "install", "--bmdb-url", bmdb_url),
                        *(a for p in provider_ids for a in ("--machine", str(ids[p]))),
                        *("--cluster-info", str(cluster), "--ticket", ticket),
                        *("--owner-public-key", str(owner_key)),
                        *("--image-server", images, "--image-digest", f"sha256:{digest}"),
                        *("--insecure-plain-http", "--root-device", "disk0"),
                    )
                    assert "3 machine(s): 3 requested, 0 refused" in out, out

                    access = load_owner(root, pki.decode_private_key(owner_key.read_bytes()))
                    nursery.start_soon(run_approver, access, conn, 0.3)

                    async def nodes() -> dict[str, NodeRow]:
                        async with access.open() as owner:
                            return {r.address: r for r in await owner.nodes()}

                    hosts = [m.host for m in machines]

                    async def all_healthy() -> bool:
                        rows = await nodes()
                        return sorted(rows) == sorted([FIRST, *hosts]) and all(
                            r.state == "UP" and r.health == "HEALTHY" for r in rows.values()
                        )

                    await _until(all_healthy)
                    rows = await nodes()

                    # The BMDB: each machine installed, with its node's id.
                    for machine, provider_id in zip(machines, provider_ids, strict=True):

                        async def installation(
                            q: Queries, p: str = provider_id
                        ) -> OSInstallation | None:
                            return await q.os_installation(ids[p])

                        got = await conn.transact(installation)
                        assert got is not None and got.state is InstallState.INSTALLED, got
                        assert got.node_public_key is not None
                        assert node_id(got.node_public_key) == rows[machine.host].node_id
                        key = (machine.root / DISK / "node.key.pub").read_bytes()
                        assert got.node_public_key == key

                    # One granted ConsensusMember becomes an etcd voter.
                    chosen = rows[hosts[0]]
                    await _cli(*owner_cli, "set-roles", chosen.node_id, "--consensus-member", "on")

                    async def voter() -> bool:
                        async with Client(root.ephemeral.consensus / SOCKET_NAME) as etcd:
                            members: list[Member] = await etcd.member_list()
                        return len(members) == 2 and any(
                            m.name == chosen.node_id and not m.is_learner for m in members
                        )

                    await _until(voter)

                    # A node outlives its agent: SIGKILL, then it still heartbeats.
                    victim = machines[1]
                    target = victim.root / "root" / "agent"
                    disk = victim.root / DISK
                    running = node_pid(disk)
                    assert running is not None
                    kill_agent(target)

                    async def agent_gone() -> bool:
                        return agent_pid(target) is None

                    killed = trio.current_time()
                    await _until(agent_gone)

                    async def beats_after_the_kill() -> bool:
                        row = (await nodes())[victim.host]
                        since = row.since_heartbeat
                        return since is not None and since < trio.current_time() - killed

                    await _until(beats_after_the_kill)
                    assert (await nodes())[victim.host].health == "HEALTHY"
                    assert node_pid(disk) == running

                    nursery.cancel_scope.cancel()
            # Leaving the fleet stopped its agents and nodes (SIGTERM): wait for them.
            await _until(_no_processes(short_tmp))
    finally:
        # Only if the test failed before the fleet stopped them.
        for disk in disks:
            kill_agent(disk.parents[1] / "agent")
            pid = node_pid(disk)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
    assert _processes_under(short_tmp) == []


def _no_processes(folder: Path) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not _processes_under(folder)

    return check
