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

import os
import re
import shutil
import ssl
from pathlib import Path

import trio
import trio_asyncio

from bmdb.model import InstallState
from shepherd.install import ImageRef, check_image
from shepherd.localfleet import agent_pid, node_pid
from shepherd.ssh_key import SSHKey
from tests.fixtures.install_rig import HeldLink, kill_everything_under, open_rig, until
from tests.shepherd.agents import kill_agent

BOUND = 60.0

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
                recover_after=3.0,
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
