"""Rolling upgrades end to end on real nodes: the loopback install rig, the real
Shepherd loops (the upgrader among them), real agents playing the A/B boots
of their loopback disks, a real cluster deciding who is healthy.

A cluster is bootstrapped on 127.B.1.1; three loopback machines install the
session's node image and register; two of them get ConsensusMember (etcd
then has three voters: the first node and those two). The tests then:

* upgrade all three machines to a second image (the same node in other
  bytes, `tests.fixtures.image.image_variant`) with ``python -m shepherd
  upgrade --all --wait``, stop the Shepherd while a consensus member is
  being upgraded and start it again; and check, from samples of the BMDB
  and the cluster taken all along, the order (the worker first, then the
  members one at a time), that never more than one node was down in the
  cluster's view, and that every node ends on the new image, healthy, its
  slot permanent, the two members voters again;
* upgrade the worker to an image whose node cannot start: its agent goes
  back to the old slot by itself, the run stops at it with that cause, the
  node is healthy on the old image and says it went back, and the members
  (which wrote the image at the run's start, as every machine does) were
  never activated.

The real-disk half of the A/B machine (slots on a block device, bootprep,
the boot check) is tested on loop devices in
tests/shepherd/test_agent_abslots.py; the same state machine runs here in
the agents.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb.model import MachineUpgrade, Queries, UpgradeRun, UpgradeState
from metropolis.owner import NodeRow
from shepherd.approver import run_approver
from shepherd.ssh_key import SSHKey
from shepherd.upgrader import Upgrader
from tests.fixtures.image import broken_image, image_variant
from tests.fixtures.install_rig import (
    Cluster,
    Rig,
    cli,
    kill_everything_under,
    open_cluster,
    open_rig,
    processes_under,
    until,
)

BOUND = 400.0
HEALTH_TIMEOUT = 60


def _images(folder: Path, node_image: Path) -> tuple[Path, Path, Path]:
    """The served image folder: the session's image, a second one, a broken one."""
    folder.mkdir()
    first = folder / node_image.name
    first.write_bytes(node_image.read_bytes())
    return first, image_variant(first, "upgrade test: second image", folder), broken_image(folder)


@asynccontextmanager
async def _installed(
    short_tmp: Path, bmdb_url: str, ssh_key: SSHKey, first: Path
) -> AsyncIterator[tuple[Cluster, Rig, dict[str, NodeRow]]]:
    """A cluster and a rig of three machines serving the images beside
    ``first``, the Shepherd restarted with an upgrader, and the machines
    installed from ``first`` (`_installed_cluster`'s nodes by address)."""
    async with (
        open_cluster(short_tmp) as cluster,
        open_rig(
            short_tmp, bmdb_url=bmdb_url, ssh_key=ssh_key, image_dir=first.parent, count=3
        ) as rig,
    ):
        rig.upgrader = Upgrader(cluster.access, poll=0.3, stage_allowance=120)
        await rig.stop_shepherd()
        await rig.start_shepherd()
        yield cluster, rig, await _installed_cluster(rig, cluster, first)


def _upgrade_argv(bmdb_url: str, rig: Rig, cluster: Cluster, digest: str) -> list[str]:
    """``shepherd upgrade`` of every machine to ``digest``, waiting for the end."""
    return [
        *(sys.executable, "-m", "shepherd", "upgrade", "--bmdb-url", bmdb_url),
        *("--all", "--image-server", rig.images, "--image-digest", digest),
        *("--insecure-plain-http", "--health-timeout", str(HEALTH_TIMEOUT)),
        *("--cluster-owner-root", str(cluster.root.path)),
        *("--cluster-owner-key", str(cluster.owner_key), "--wait"),
    ]


async def _installed_cluster(rig: Rig, cluster: Cluster, first: Path) -> dict[str, NodeRow]:
    """Install the three machines, approve their nodes, make two of them
    consensus members; the nodes by machine address."""
    digest = first.name.removesuffix(".pyz")
    await rig.request(rig.image(digest), cluster.node_parameters(), machines=[0, 1, 2])
    rig.nursery.start_soon(run_approver, cluster.access, rig.conn, 0.3)
    hosts = [m.host for m in rig.machines]

    async def healthy() -> bool:
        rows = {r.address: r for r in await cluster.nodes()}
        return all(
            h in rows and rows[h].state == "UP" and rows[h].health == "HEALTHY" for h in hosts
        )

    await until(healthy, interval=0.3)
    rows = {r.address: r for r in await cluster.nodes()}
    for host in hosts[:2]:
        await cli(*cluster.owner_cli, "set-roles", rows[host].node_id, "--consensus-member", "on")

    async def voters() -> bool:
        got = {r.address: r for r in await cluster.nodes()}
        return all(got[h].etcd == "voter" and got[h].health == "HEALTHY" for h in hosts[:2])

    await until(voters, interval=0.3)
    return {r.address: r for r in await cluster.nodes()}


async def _run_state(
    conn: bmdb.Connection,
) -> tuple[UpgradeRun | None, list[MachineUpgrade]]:
    async def body(q: Queries) -> tuple[UpgradeRun | None, list[MachineUpgrade]]:
        runs = await q.upgrade_runs(1)
        if not runs:
            return None, []
        return runs[0], [m for m, _ in await q.upgrade_machines(runs[0].run_id)]

    return await conn.transact(body)


async def _finished(done: list[subprocess.CompletedProcess[bytes]]) -> bool:
    return bool(done)


class Watch:
    """Samples of the run and the cluster, taken until cancelled."""

    def __init__(self, rig: Rig, cluster: Cluster) -> None:
        self.rig = rig
        self.cluster = cluster
        #: Most machines requested at once, and most nodes down at once.
        self.most_requested = 0
        self.most_down = 0
        #: Machines in the order they were first seen requested.
        self.requested: list[uuid.UUID] = []
        self.down_samples: list[list[str]] = []

    async def run(self) -> None:
        while True:
            _, machines = await _run_state(self.rig.conn)
            now = [m.machine_id for m in machines if m.state is UpgradeState.REQUESTED]
            self.most_requested = max(self.most_requested, len(now))
            for mid in now:
                if mid not in self.requested:
                    self.requested.append(mid)
            try:
                rows = await self.cluster.nodes()
            except Exception:  # a failover: the next sample says
                rows = []
            down = [r.node_id for r in rows if r.health != "HEALTHY"]
            if len(down) > self.most_down:
                self.most_down = len(down)
                self.down_samples.append(down)
            await trio.sleep(0.2)


async def test_a_cluster_is_upgraded_in_order_through_a_shepherd_restart(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    first, second, _ = _images(short_tmp / "images", node_image)
    new = "sha256:" + second.name.removesuffix(".pyz")
    try:
        with trio.fail_after(BOUND):
            async with _installed(short_tmp, bmdb_url, shepherd_ssh_key, first) as (
                cluster,
                rig,
                before,
            ):
                hosts = [m.host for m in rig.machines]
                worker, members = rig.ids[2], rig.ids[:2]
                watch = Watch(rig, cluster)
                done: list[subprocess.CompletedProcess[bytes]] = []

                async def upgrade() -> None:
                    done.append(
                        await trio.run_process(
                            _upgrade_argv(bmdb_url, rig, cluster, new),
                            capture_stdout=True,
                            capture_stderr=True,
                            check=False,
                        )
                    )

                async with trio.open_nursery() as sampling:
                    sampling.start_soon(watch.run)
                    sampling.start_soon(upgrade)

                    # The Shepherd dies while the first member is upgraded.
                    async def member_requested() -> bool:
                        _, machines = await _run_state(rig.conn)
                        return any(
                            m.machine_id in members and m.state is UpgradeState.REQUESTED
                            for m in machines
                        )

                    await until(member_requested, interval=0.2)
                    await rig.stop_shepherd()
                    await trio.sleep(3)
                    await rig.start_shepherd()
                    await until(lambda: _finished(done))
                    sampling.cancel_scope.cancel()
                [follow] = done
                out = follow.stdout.decode() + follow.stderr.decode()
                assert follow.returncode == 0, out
                run, machines = await _run_state(rig.conn)
                assert run is not None and run.finished_at is not None and run.stop_cause is None
                assert all(m.state is UpgradeState.UPGRADED for m in machines), machines
                # The order: the worker, then the members one at a time.
                assert watch.requested[0] == worker, watch.requested
                assert set(watch.requested[1:]) == set(members)
                assert watch.most_requested == 1
                assert watch.most_down <= 1, watch.down_samples
                # The cluster's own view: the new image, permanent, the members voters.
                after = {r.address: r for r in await cluster.nodes()}
                for host in hosts:
                    row = after[host]
                    assert row.node_id == before[host].node_id  # the same node, its data kept
                    assert (row.image, row.trial, row.health) == (new, False, "HEALTHY"), row
                    assert row.slot == "B"
                for host in hosts[:2]:
                    assert after[host].etcd == "voter"
                # bmdb machines shows each machine's slot, image and upgrade state.
                table = await cli("bmdb", "--url", bmdb_url, "machines")
                for mid in rig.ids:
                    line = next(x for x in table.splitlines() if str(mid) in x)
                    assert "upgraded" in line and new[7:19] in line and " B " in line, line
    finally:
        kill_everything_under(short_tmp)
    assert processes_under(short_tmp) == []


async def test_an_image_that_cannot_start_goes_back_and_stops_the_run(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    first, _, broken = _images(short_tmp / "images", node_image)
    bad = "sha256:" + broken.name.removesuffix(".pyz")
    old = "sha256:" + first.name.removesuffix(".pyz")
    try:
        with trio.fail_after(BOUND):
            async with _installed(short_tmp, bmdb_url, shepherd_ssh_key, first) as (
                cluster,
                rig,
                before,
            ):
                worker_host = rig.machines[2].host
                result = await trio.run_process(
                    _upgrade_argv(bmdb_url, rig, cluster, bad),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                out = result.stdout.decode()
                assert result.returncode == 1, (out, result.stderr.decode())
                assert f"stopped: machine {rig.ids[2]} rolled-back" in out, out
                assert "exited before it was healthy" in out, out
                run, machines = await _run_state(rig.conn)
                assert run is not None and run.stop_cause is not None
                by_id = {m.machine_id: m for m in machines}
                assert by_id[rig.ids[2]].state is UpgradeState.ROLLED_BACK
                # The members wrote the image at the run's start but were
                # never activated, and the cluster is untouched.
                assert all(by_id[m].state is UpgradeState.PENDING for m in rig.ids[:2])
                assert all(by_id[m].requested_at is None for m in rig.ids[:2])
                assert all(by_id[m].agent_state == "written" for m in rig.ids[:2])

                # Waited for with its rollback: the status the node pushed
                # before the upgrade (old image, HEALTHY until its heartbeat
                # times out) says the same of image and health, and the run
                # can stop before the node back on slot A has pushed.
                async def back_and_healthy() -> bool:
                    row = {r.address: r for r in await cluster.nodes()}[worker_host]
                    return row.health == "HEALTHY" and row.image == old and bool(row.rolled_back)

                await until(back_and_healthy, interval=0.3)
                row = {r.address: r for r in await cluster.nodes()}[worker_host]
                assert row.node_id == before[worker_host].node_id
                assert row.rolled_back == bad and "exited" in row.rollback_cause
                assert (row.slot, row.trial) == ("A", False)
                # owner nodes says it too.
                table = await cli(*cluster.owner_cli, "nodes")
                assert f"went back to slot A from image {bad}" in table, table
    finally:
        kill_everything_under(short_tmp)
    assert processes_under(short_tmp) == []
