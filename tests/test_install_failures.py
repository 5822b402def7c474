"""The installation flow when things go wrong, real everything.

Each test brings up the real parts (`tests.fixtures.install_rig`):
PostgreSQL's BMDB, loopback machines taken over over SSH by the real
initializer, the real agent heartbeating to the real agent callback server,
the real image server serving the node image this test session built; the
clustered ones bootstrap a real cluster that the installed nodes join. A
request is written as ``python -m shepherd install`` writes it; what the
tests check is what the BMDB, the machines' disk folders and the processes
say. Run under the net lock (fixed loopback addresses and node ports).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import ssl
from pathlib import Path

import trio
import trio_asyncio

from bmdb.model import InstallState, node_id
from shepherd.approver import run_approver
from shepherd.install import ImageRef, check_image
from shepherd.localfleet import agent_pid, node_pid
from shepherd.ssh_key import SSHKey
from tests.fixtures.install_rig import (
    HeldLink,
    cli,
    kill_everything_under,
    open_cluster,
    open_rig,
    until,
)
from tests.shepherd.agents import kill_agent

#: A bound on a hung test, not a time it must keep: each test here starts
#: PostgreSQL, a fleet, a first node and installed nodes, which took 60 s
#: under two suite workers beside other load (2 cores).
BOUND = 150.0

#: What the node parameters of a request that never starts a node hold.
UNUSED_PARAMETERS = b"\x0a\x00"


def _digest(image: Path) -> str:
    return image.name.removesuffix(".pyz")


def _private_copy(image: Path, folder: Path) -> Path:
    """A copy of the session's image in an image folder of this test only."""
    folder.mkdir()
    copy = folder / image.name
    shutil.copyfile(image, copy)
    return copy


def _rot_in_place(path: Path) -> None:
    """Flip one byte of ``path``, keeping its inode, size and times."""
    info = path.stat()
    with path.open("r+b") as f:
        f.seek(info.st_size // 2)
        byte = f.read(1)
        f.seek(info.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def _log(rig_agent: Path) -> str:
    return rig_agent.with_name("agent.log").read_text()


async def test_a_wrong_digest_fails_with_its_cause_starts_nothing_and_leaves_nothing(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers, the SSH client
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    served = _private_copy(node_image, short_tmp / "images")
    digest = _digest(node_image)
    try:
        with trio.fail_after(BOUND):
            async with open_rig(
                short_tmp, bmdb_url=bmdb_url, ssh_key=shepherd_ssh_key, image_dir=served.parent
            ) as rig:
                # The image server checks the file once, when it is first asked
                # for (here by the HEAD of `shepherd install`); then its copy
                # rots in place, unseen by that check: the server sends bytes
                # that are not the digest, and only the agent's check is left.
                await check_image(rig.image(digest), ssl.create_default_context())
                _rot_in_place(served)
                await rig.request(rig.image(digest), UNUSED_PARAMETERS)

                got = await rig.reported(0, 1)
                assert got.state is InstallState.INSTALL_FAILED, got
                assert got.cause is not None
                assert "image digest mismatch" in got.cause, got.cause
                assert f"the request wants sha256:{digest}" in got.cause, got.cause
                assert got.node_public_key is None
                assert os.listdir(rig.disk(0)) == []  # not even the temporary file
                assert node_pid(rig.disk(0)) is None
                assert (
                    "node-started" not in rig.agent(0).with_name("agent.install.json").read_text()
                )
    finally:
        kill_everything_under(short_tmp)


async def test_an_image_server_that_is_down_is_retried_with_backoff_then_reported(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    deadline = 3.0
    try:
        with trio.fail_after(BOUND):
            async with open_rig(
                short_tmp,
                bmdb_url=bmdb_url,
                ssh_key=shepherd_ssh_key,
                image_dir=node_image.parent,
                install_download_deadline=deadline,
                install_backoff_start=0.2,
                install_backoff_cap=0.8,
            ) as rig:
                image = rig.image(_digest(node_image))
                rig.stop_images()
                await rig.request(image, UNUSED_PARAMETERS)

                got = await rig.reported(0, 1)
                assert got.state is InstallState.INSTALL_FAILED, got
                assert got.cause is not None
                given_up = re.search(
                    r"download of (\S+) gave up after ([0-9]+) attempts in ([0-9]+)s: (.*)",
                    got.cause,
                )
                assert given_up is not None, got.cause
                url, attempts, seconds, last = given_up.groups()
                assert url == image.url
                assert "refused" in last.lower(), last
                # Pauses doubling from 0.1-0.2 s up to 0.4-0.8 s fit 3 to 10
                # attempts in 3 s (a fixed pause would fit 15 or more; none,
                # thousands); and it gave up at the deadline, not before.
                assert 3 <= int(attempts) <= 10, got.cause
                assert int(seconds) in (2, 3), got.cause
                # Each attempt is in the agent's log.
                tried = _log(rig.agent(0)).count(f"generation 1: download from {url}: ")
                assert tried == int(attempts)
                assert os.listdir(rig.disk(0)) == []
                assert node_pid(rig.disk(0)) is None
    finally:
        kill_everything_under(short_tmp)


async def test_an_agent_killed_mid_download_is_recovered_and_reports_without_a_rerun(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    try:
        with trio.fail_after(BOUND):
            async with open_rig(
                short_tmp,
                bmdb_url=bmdb_url,
                ssh_key=shepherd_ssh_key,
                image_dir=node_image.parent,
                recover_after=4.0,
            ) as rig:
                images_port = int(rig.images.rsplit(":", 1)[1])
                link = HeldLink(images_port, hold_after=4 * 1024 * 1024)
                await rig.nursery.start(link.serve)
                digest = _digest(node_image)
                await rig.request(ImageRef("http", link.host, digest), UNUSED_PARAMETERS)
                disk, agent, machine = rig.disk(0), rig.agent(0), rig.machines[0]

                async def halfway() -> bool:
                    parts = [p for p in disk.iterdir() if p.name.endswith(".part")]
                    return link.holding == 1 and bool(parts) and parts[0].stat().st_size > 0

                await until(halfway)
                first = agent_pid(agent)
                assert first is not None and machine.execs == 1
                kill_agent(agent)  # SIGKILL, mid-download

                # The recoverer finds the agent silent and has it started
                # again; the new agent reports the generation it finds begun.
                got = await rig.reported(0, 1)
                assert got.state is InstallState.INSTALL_FAILED, got
                assert got.cause is not None and got.cause.startswith("interrupted: "), got.cause
                assert machine.execs == 2
                assert agent_pid(agent) not in (None, first)
                assert link.connections == 1  # not downloaded again
                assert _log(agent).count("generation 1: installing") == 1
                assert os.listdir(disk) == []  # the half download removed, nothing started
    finally:
        kill_everything_under(short_tmp)


async def test_an_agent_killed_before_its_report_is_recovered_and_the_report_arrives(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
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
                    recover_after=4.0,
                ) as rig,
            ):
                images_port = int(rig.images.rsplit(":", 1)[1])
                link = HeldLink(images_port, hold_after=4 * 1024 * 1024)
                await rig.nursery.start(link.serve)
                image = ImageRef("http", link.host, _digest(node_image))
                await rig.request(image, cluster.node_parameters())
                disk, agent, machine = rig.disk(0), rig.agent(0), rig.machines[0]
                await until(lambda: _true(link.holding == 1))

                # The Shepherd goes down mid-download, so that the install
                # ends with no one to report to; the agent dies right after
                # it started the node.
                await rig.stop_shepherd()
                link.release()
                await until(lambda: _true(node_pid(disk) is not None), interval=0.01)
                node = node_pid(disk)
                first = agent_pid(agent)
                assert first is not None
                kill_agent(agent)
                assert (await rig.installation(0)).state is InstallState.INSTALLING  # type: ignore[union-attr]

                # The Shepherd is back; its recoverer finds the agent silent
                # and has it started again, which reports the generation it
                # finds begun: the node's key, not a second install.
                await rig.start_shepherd()
                got = await rig.reported(0, 1)
                assert got.state is InstallState.INSTALLED, got
                assert got.node_public_key == (disk / "node.key.pub").read_bytes()
                assert machine.execs == 2
                assert agent_pid(agent) not in (None, first)
                assert node_pid(disk) == node  # the same node, never started again
                assert link.connections == 1  # the image downloaded once
                assert _log(agent).count("generation 1: installing") == 1

                # And the node it started registered, waiting for approval.
                async def registered() -> bool:
                    assert got.node_public_key is not None
                    wanted = node_id(got.node_public_key)
                    rows = await cluster.nodes()
                    return any(r.node_id == wanted and r.state == "NEW" for r in rows)

                await until(registered)
    finally:
        kill_everything_under(short_tmp)


async def test_a_new_generation_after_a_failure_installs_and_the_node_joins(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    missing = hashlib.sha256(b"no such image").hexdigest()
    try:
        with trio.fail_after(BOUND):
            async with (
                open_cluster(short_tmp) as cluster,
                open_rig(
                    short_tmp,
                    bmdb_url=bmdb_url,
                    ssh_key=shepherd_ssh_key,
                    image_dir=node_image.parent,
                ) as rig,
            ):
                disk, machine = rig.disk(0), rig.machines[0]
                # Generation 1 names an image the server does not have.
                await rig.request(rig.image(missing), cluster.node_parameters())
                failed = await rig.reported(0, 1)
                assert failed.state is InstallState.INSTALL_FAILED, failed
                assert failed.cause is not None and "HTTP 404" in failed.cause, failed.cause
                assert os.listdir(disk) == []

                # The operator asks again, with the right image: no --reinstall
                # needed after a failure.
                out = await cli(
                    *("shepherd", "install", "--bmdb-url", bmdb_url),
                    *("--machine", str(rig.ids[0])),
                    *("--cluster-info", str(cluster.info), "--ticket", cluster.ticket),
                    *("--owner-public-key", str(cluster.owner_key)),
                    *("--image-server", rig.images),
                    *("--image-digest", f"sha256:{_digest(node_image)}"),
                    *("--insecure-plain-http", "--root-device", "disk0"),
                )
                assert f"requested {rig.ids[0]} generation 2 " in out, out
                got = await rig.reported(0, 2)
                assert got.state is InstallState.INSTALLED, got
                assert got.node_public_key == (disk / "node.key.pub").read_bytes()
                assert node_pid(disk) is not None

                rig.nursery.start_soon(run_approver, cluster.access, rig.conn, 0.3)

                async def healthy() -> bool:
                    row = await cluster.node_at(machine.host)
                    return row is not None and row.state == "UP" and row.health == "HEALTHY"

                await until(healthy)
                row = await cluster.node_at(machine.host)
                assert row is not None
                assert row.node_id == node_id(got.node_public_key)
    finally:
        kill_everything_under(short_tmp)


async def test_a_node_outlives_its_agent_and_a_restart_of_the_shepherd(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
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
                    recover_after=4.0,
                ) as rig,
            ):
                disk, agent, machine = rig.disk(0), rig.agent(0), rig.machines[0]
                await rig.request(rig.image(_digest(node_image)), cluster.node_parameters())
                installed = await rig.reported(0, 1)
                assert installed.state is InstallState.INSTALLED, installed
                rig.nursery.start_soon(run_approver, cluster.access, rig.conn, 0.3)

                async def healthy() -> bool:
                    row = await cluster.node_at(machine.host)
                    return row is not None and row.state == "UP" and row.health == "HEALTHY"

                await until(healthy)
                node = node_pid(disk)
                image = (disk / "image.pyz").stat()
                first = agent_pid(agent)
                assert node is not None and first is not None

                # The agent dies; the Shepherd stops and starts again.
                kill_agent(agent)
                await until(lambda: _true(agent_pid(agent) is None))
                await rig.stop_shepherd()
                down = trio.current_time()
                await trio.sleep(1.0)  # down for a while: the node is on its own
                await rig.start_shepherd()

                # The recoverer has the agent started again, which heartbeats
                # and installs nothing: its generation is reported already.
                await until(lambda: _true(machine.execs == 2))
                await until(lambda: _true(_log(agent).count("hardware report accepted") >= 2))

                # The node kept running, heartbeats to the cluster after all
                # that, and is healthy.
                async def beats_since_down() -> bool:
                    row = await cluster.node_at(machine.host)
                    since = row.since_heartbeat if row is not None else None
                    return since is not None and since < trio.current_time() - down

                await until(beats_since_down)
                row = await cluster.node_at(machine.host)
                assert row is not None
                assert (row.state, row.health) == ("UP", "HEALTHY")
                assert node_pid(disk) == node
                assert agent_pid(agent) not in (None, first)
                after = (disk / "image.pyz").stat()
                assert (after.st_ino, after.st_mtime_ns) == (image.st_ino, image.st_mtime_ns)
                assert _log(agent).count("generation 1: installing") == 1
                still = await rig.installation(0)
                assert still is not None and (still.generation, still.state) == (
                    1,
                    InstallState.INSTALLED,
                )
                assert still.node_public_key == installed.node_public_key
    finally:
        kill_everything_under(short_tmp)


async def _true(value: bool) -> bool:
    return value
