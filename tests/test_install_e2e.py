"""The whole installation flow, real everything: three taken-over machines become nodes.

PostgreSQL holds the BMDB; three loopback machines (`shepherd.localfleet`,
127.B.0.2-4 in this test process's block B of `tests.loopback`) are taken
over by the real initializer (the control loop, SSH, the uploaded agent),
whose agents heartbeat to the real agent callback server; its image server
serves the node image this test session built.
A first node bootstraps the cluster on 127.B.1.1 (its own address: the
fleet's machines run their nodes on 127.B.0.N, on the nodes' fixed
ports). ``python -m shepherd install`` asks the three agents to install;
each downloads and verifies the image, starts its node, which registers;
the Shepherd's approver approves exactly those nodes. Then: four nodes UP
and healthy, each machine installed with its node's id, a granted
ConsensusMember votes in etcd, and a node outlives its agent's SIGKILL.
The parts are brought up by `tests.fixtures.install_rig`, which the tests
of the flow's failures (tests/test_install_failures.py) share.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import trio
import trio_asyncio

from bmdb.model import InstallState, OSInstallation, Queries, node_id
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.owner import NodeRow
from shepherd.approver import run_approver
from shepherd.localfleet import DISK, agent_pid, node_pid
from shepherd.ssh_key import SSHKey
from tests import loopback
from tests.fixtures.install_rig import (
    FIRST,
    cli,
    kill_everything_under,
    open_cluster,
    open_rig,
    processes_under,
    until,
)
from tests.shepherd.agents import kill_agent

BOUND = 50.0


async def test_three_taken_over_machines_become_approved_healthy_nodes(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers, the SSH client
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    try:
        with trio.fail_after(BOUND):
            async with (
                open_cluster(short_tmp) as cluster,
                open_rig(
                    short_tmp,
                    bmdb_url=bmdb_url,
                    ssh_key=shepherd_ssh_key,
                    image_dir=node_image.parent,
                    count=3,
                ) as rig,
            ):
                # Taken over: every agent has heartbeated with its hardware report.
                machines = rig.machines
                assert [m.host for m in machines] == loopback.fleet_hosts(3)
                digest = node_image.name.removesuffix(".pyz")
                out = await cli(
                    *("shepherd", "install", "--bmdb-url", bmdb_url),
                    *(a for machine_id in rig.ids for a in ("--machine", str(machine_id))),
                    *("--cluster-info", str(cluster.info), "--ticket", cluster.ticket),
                    *("--owner-public-key", str(cluster.owner_key)),
                    *("--image-server", rig.images, "--image-digest", f"sha256:{digest}"),
                    *("--insecure-plain-http", "--root-device", "disk0"),
                )
                assert "3 machine(s): 3 requested, 0 refused" in out, out

                rig.nursery.start_soon(run_approver, cluster.access, rig.conn, 0.3)

                async def nodes() -> dict[str, NodeRow]:
                    return {r.address: r for r in await cluster.nodes()}

                hosts = [m.host for m in machines]

                async def all_healthy() -> bool:
                    rows = await nodes()
                    return sorted(rows) == sorted([FIRST, *hosts]) and all(
                        r.state == "UP" and r.health == "HEALTHY" for r in rows.values()
                    )

                await until(all_healthy, interval=0.2)
                rows = await nodes()
                # Each installed node reports the image it runs; a loopback
                # disk has no slot.
                for host in hosts:
                    assert rows[host].image == f"sha256:{digest}", rows[host]
                    assert rows[host].slot == "-" and not rows[host].trial

                # The BMDB: each machine installed, with its node's id.
                for machine, machine_id in zip(machines, rig.ids, strict=True):

                    async def installation(
                        q: Queries, m: uuid.UUID = machine_id
                    ) -> OSInstallation | None:
                        return await q.os_installation(m)

                    got = await rig.conn.transact(installation)
                    assert got is not None and got.state is InstallState.INSTALLED, got
                    assert got.node_public_key is not None
                    assert node_id(got.node_public_key) == rows[machine.host].node_id
                    key = (machine.root / DISK / "node.key.pub").read_bytes()
                    assert got.node_public_key == key

                # One granted ConsensusMember becomes an etcd voter.
                chosen = rows[hosts[0]]
                await cli(
                    *cluster.owner_cli, "set-roles", chosen.node_id, "--consensus-member", "on"
                )

                async def voter() -> bool:
                    async with Client(cluster.root.ephemeral.consensus / SOCKET_NAME) as etcd:
                        members: list[Member] = await etcd.member_list()
                    return len(members) == 2 and any(
                        m.name == chosen.node_id and not m.is_learner for m in members
                    )

                await until(voter, interval=0.2)

                # A node outlives its agent: SIGKILL, then it still heartbeats.
                victim = machines[1]
                target = rig.agent(1)
                disk = rig.disk(1)
                running = node_pid(disk)
                assert running is not None
                kill_agent(target)

                async def agent_gone() -> bool:
                    return agent_pid(target) is None

                killed = trio.current_time()
                await until(agent_gone)

                async def beats_after_the_kill() -> bool:
                    row = (await nodes())[victim.host]
                    since = row.since_heartbeat
                    return since is not None and since < trio.current_time() - killed

                await until(beats_after_the_kill, interval=0.2)
                assert (await nodes())[victim.host].health == "HEALTHY"
                assert node_pid(disk) == running
            # Leaving the rig stopped the agents and nodes (SIGTERM) and
            # waited for them; leaving the cluster stopped its first node.
    finally:
        # Only if the test failed before the fleet stopped them.
        kill_everything_under(short_tmp)
    assert processes_under(short_tmp) == []
