"""Hostile installation requests, carried by the real agent callback server
to the real agent on loopback machines (`tests.fixtures.install_rig`): each is
refused with a cause that reaches the BMDB as the generation's failure, and
nothing is written on any disk or outside the machine.

The requests are written into the BMDB as they are (``shepherd install``
builds only well-formed ones, tested in tests/shepherd/test_install.py):
what a compromised or buggy writer of the BMDB could store. Refused by the
agent callback server (`shepherd.agent_server.reports.request_refusal`):
requests the agent could not read at all, or one whose generation is not
the row's. Refused by the agent (`shepherd.agent.installplan.check_request`,
tested one by one in tests/shepherd/test_agent_install.py): the rest. Run
under the net lock.
"""

from __future__ import annotations

import os
from pathlib import Path

import trio
import trio_asyncio

from bmdb.model import InstallState, Queries
from shepherd.install import Plan, request_bytes
from shepherd.ssh_key import SSHKey
from tests.fixtures.install_rig import AGENT, kill_everything_under, open_rig

BOUND = 60.0
MIB = 1024 * 1024


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _len(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


async def test_hostile_requests_are_refused_with_a_cause_in_the_bmdb(
    short_tmp: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers, the SSH client
    bmdb_url: str,
    node_image: Path,
    shepherd_ssh_key: SSHKey,
) -> None:
    digest = node_image.name.removesuffix(".pyz")
    outside = short_tmp / "outside"
    outside.mkdir()
    try:
        with trio.fail_after(BOUND):
            async with open_rig(
                short_tmp,
                bmdb_url=bmdb_url,
                ssh_key=shepherd_ssh_key,
                image_dir=node_image.parent,
                count=8,
            ) as rig:
                image = rig.image(digest)

                def plan(root_device: str = "disk0", parameters: bytes = b"\x0a\x00") -> Plan:
                    return Plan(parameters, image, root_device)

                def good(index: int, p: Plan, generation: int = 1) -> bytes:
                    return request_bytes(p, generation, rig.machines[index].host)

                # A disk of the machine that is a link to a folder outside it.
                (rig.machines[7].root / AGENT).with_name("disks").joinpath("outside").symlink_to(
                    outside
                )
                bad_image = _len(1, b"http") + b"\x10\x07"  # host (2) a varint
                cases: dict[int, tuple[bytes, str]] = {
                    0: (good(0, plan(parameters=b"x" * 3 * MIB)), "over the bound of"),
                    1: (
                        good(1, plan(parameters=b"x" * (MIB + MIB // 2))),
                        "node_parameters of 1572864 bytes, over the bound of 1048576",
                    ),
                    2: (  # root_device (3) a varint
                        b"\x08\x01" + _len(2, b"\x18\x05"),
                        "request does not decode",
                    ),
                    3: (_len(1, b"1") + _len(2, b""), "request does not decode"),  # generation
                    4: (good(4, plan(), generation=7), "request names generation 7"),
                    5: (b"\x08\x01" + _len(2, _len(4, bad_image)), "request does not decode"),
                    6: (
                        good(6, plan(root_device="../../../../etc")),
                        "root device '../../../../etc' is not one of this machine's loopback "
                        "disks (disk0)",
                    ),
                    7: (
                        good(7, plan(root_device="outside")),
                        "root device 'outside' is not one of this machine's loopback disks (disk0)",
                    ),
                }
                for index, (raw, _) in cases.items():

                    async def write(q: Queries, i: int = index, r: bytes = raw) -> None:
                        await q.set_os_installation_request(rig.ids[i], 1, r)

                    await rig.conn.transact(write)

                server_refusal = "refused by the agent callback server, not sent to the agent: "
                for index, (_, cause) in cases.items():
                    got = await rig.reported(index, 1)
                    assert got.state is InstallState.INSTALL_FAILED, (index, got)
                    assert got.cause is not None and cause in got.cause, (index, got.cause)
                    by_server = index in (0, 2, 3, 4, 5)
                    assert got.cause.startswith(server_refusal) == by_server, (index, got.cause)
                    assert os.listdir(rig.disk(index)) == [], index
                assert os.listdir(outside) == []

                # The agents went on: none ignored an answer, and the one
                # whose request named generation 7 never saw it, so it takes
                # generation 2 (and refuses it for its own cause).
                for index in cases:
                    log = rig.agent(index).with_name("agent.log").read_text()
                    assert "ignoring" not in log, (index, log)
                    ran = "generation 1: installing" in log
                    assert ran == (index in (1, 6, 7)), (index, log)

                async def again(q: Queries) -> None:
                    await q.set_os_installation_request(rig.ids[4], 2, good(4, plan("disk9"), 2))

                await rig.conn.transact(again)
                second = await rig.reported(4, 2)
                assert second.state is InstallState.INSTALL_FAILED, second
                assert second.cause is not None
                assert second.cause.startswith("root device 'disk9' is not one"), second.cause
    finally:
        kill_everything_under(short_tmp)
