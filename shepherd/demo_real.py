"""``bin/demo --real-machines``: the whole path on real Linux machines.

Where the default demo's machines are SSH servers on loopback, these are
``systemd-nspawn --boot`` Debian 12 machines (`shepherd.nspawn`): systemd
as PID 1, a NIC of their own on a bridge, a loop-device disk, power
through a Redfish BMC; the Shepherd's path is `shepherd.realfleet`'s::

    machines      N machines booted, their BMC and the static provider's list
    takeover      the initializer over SSH; the agent, a unit of each machine's
                  systemd, heartbeats with a hardware report (NIC, loop disk)
    install       each machine asked to install onto its disk: GPT, the image
                  on system A read back, boot record, data partition, the boot
                  entry last; the node runs as metropolis-node.service
    approval      the approver admits the nodes whose keys the agents reported
    consensus     ConsensusMember for two nodes, one at a time (etcd voters)
    power reset   the first consensus member reset through its BMC: it comes
                  back by itself from its disk and votes again (etcd takes a
                  write with the other member's machine powered off)
    upgrade       with --upgrade: every machine moved to a second release of
                  the image (`metropolis.image.variant`) by the Shepherd's
                  upgrader (`shepherd.upgrader`): every machine writes its
                  other slot at once (no node goes down for it), then the
                  worker, then the members one at a time, boots it once and
                  keeps it when its node is healthy
    decommission  the last machine: its node removed from the cluster, its
                  disk wiped (each step reported), released
    table         machine, address, disk, install, node, roles, health, etcd,
                  the image each node runs and its disk slot

Progress lines say what changed. Ctrl-C stops every machine (an orderly
poweroff, then forced) and detaches every loop device, removes the
bridge and namespaces, then stops PostgreSQL (`shepherd.demo`). Needs
root, systemd-nspawn and mmdebstrap (Debian: systemd-container mmdebstrap;
the first run builds the machines' root, about 95 s).
"""

from __future__ import annotations

import getpass
import logging
import os
import shutil
import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb import overview
from bmdb.actions import act
from bmdb.model import InstallState, MachineUpgrade, OSInstallation
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.errors import MetropolisError
from metropolis.image.variant import release_variant
from metropolis.owner import NodeRow
from shepherd.demo_cluster import node_image
from shepherd.install import image_from_server
from shepherd.proto.agent_callback import AgentHardwareReport
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import Credentials, RedfishClient
from shepherd.realfleet import RealFleet, open_real_fleet
from shepherd.upgrade import Options as UpgradeOptions
from shepherd.upgrade import create_run

logger = logging.getLogger("shepherd.demo_real")

#: Under the demo's working folder (short: the first node's etcd socket is under it).
REAL_DIR = "r"
#: The label of ``--upgrade``'s second release of the image (`release_variant`).
SECOND_RELEASE = "bin/demo --upgrade: a second release"
#: The tools a run needs, and the Debian packages that have them.
TOOLS = {"systemd-nspawn": "systemd-container", "mmdebstrap": "mmdebstrap", "losetup": "mount"}


@dataclass(frozen=True)
class RealOptions:
    machines: int
    deadline: float
    workdir: Path
    bmdb_url: str
    image_cache: Path
    etcd: Path
    #: Then upgrade the cluster to a second release of the image.
    upgrade: bool = False


def missing() -> str | None:
    """Why this host cannot run the machines, or None."""
    if os.geteuid() != 0:
        return "--real-machines needs root (nspawn machines, loop devices, a bridge)"
    for tool, package in TOOLS.items():
        if shutil.which(tool) is None:
            return f"--real-machines needs {tool} (Debian package {package})"
    if not Path("/dev/loop-control").exists():
        return "--real-machines needs loop devices (/dev/loop-control)"
    return None


def progress(text: str, *args: object) -> None:
    logger.info("progress: " + text, *args)


async def run_real(options: RealOptions) -> tuple[bool, str]:
    """The whole path on real machines (see the module); (every step done,
    the final table). Everything it started is stopped when it returns or
    is cancelled (Ctrl-C)."""
    image = await node_image(options.image_cache, options.etcd)
    second = None
    if options.upgrade:
        # The image server serves the image's folder: both images in one of
        # the run's own (the cache keeps one image per folder).
        served = options.workdir / "images"
        served.mkdir(exist_ok=True)
        await trio.to_thread.run_sync(shutil.copyfile, image, served / image.name)
        image = served / image.name
        second = await trio.to_thread.run_sync(release_variant, image, SECOND_RELEASE, served)
        progress("a second release of the image to upgrade to: sha256:%s", _hex(second))
    progress("booting %d nspawn machines (the first run builds their root)", options.machines)
    async with (
        trio_asyncio.open_loop(),
        open_real_fleet(
            options.workdir / REAL_DIR,
            bmdb_url=options.bmdb_url,
            count=options.machines,
            image=image,
        ) as real,
    ):
        await _taken_over(real)
        done = False
        with trio.move_on_at(options.deadline):
            done = await _path(real, second)
        if not done:
            logger.error("not every step finished (above); the table shows how far it got")
        return done, await _table(real)


async def _taken_over(real: RealFleet) -> None:
    for index, machine_id in enumerate(real.ids):

        async def read(q: bmdb.Queries, m: uuid.UUID = machine_id) -> bytes | None:
            return await q.hardware_report(m)

        raw = await real.conn.transact(read)
        report = AgentHardwareReport.parse(raw or b"").report
        nics = ", ".join(n.mac.hex(":") for n in report.network_interface) if report else "?"
        disks = (
            ", ".join(
                f"{d.serial_number} ({d.capacity_bytes >> 20} MiB)" for d in report.block_device
            )
            if report
            else "?"
        )
        progress(
            "%s taken over at %s: agent a systemd unit; NIC %s, disk %s",
            real.provider_id(index), real.machines.address(index), nics, disks,
        )  # fmt: skip


async def _path(real: RealFleet, second: Path | None = None) -> bool:
    count = len(real.ids)
    for decision in await real.request(range(count)):
        progress("install requested: %s", decision.line(dry_run=False))
    installs = await _until_reported(real)
    for index, got in enumerate(installs):
        what = (
            f"installed, node key {got.node_id}"
            if got.state is InstallState.INSTALLED
            else (f"{got.state}: {got.cause}")
        )
        progress("%s: %s", real.provider_id(index), what)
    if any(got.state is not InstallState.INSTALLED for got in installs):
        return False
    addresses = [real.machines.address(i) for i in range(count)]
    await _until(real, lambda rows, _: all(_healthy(rows.get(a)) for a in addresses))
    progress("every node approved and healthy, each a service of its machine's systemd")
    consensus = list(range(min(2, count)))
    for index in consensus:
        row = (await _nodes(real))[addresses[index]]
        async with real.first.access.open() as owner:
            await owner.set_roles(row.node_id, consensus_member=True)

        def voting(_: dict[str, NodeRow], members: list[Member], n: str = row.node_id) -> bool:
            return _voter(members, n)

        await _until(real, voting)
        progress("%s: node %s is an etcd voter", real.provider_id(index), row.node_id)
    if consensus:
        await _reset(real, consensus)
    if second is not None and not await _upgrade(real, second):
        return False
    if count > len(consensus):
        await _decommission(real, count - 1)
    return True


async def _reset(real: RealFleet, consensus: list[int]) -> None:
    """Power-reset the first consensus member through its BMC; see it back and voting."""
    index = consensus[0]
    before = (await _nodes(real))[real.machines.address(index)]
    member = next(m for m in await _members(real) if m.name == before.node_id)
    machine = real.machines.machines[index]
    boots = machine.boots
    credentials = Credentials(real.machines.bmc_username, real.machines.bmc_password)
    url = real.machines.system_url(index)
    async with RedfishClient() as redfish:
        await redfish.reset(url, credentials, "ForceRestart")
        reset_at = trio.current_time()
        progress(
            "%s: power reset through its BMC (ForceRestart at %s)", real.provider_id(index), url
        )
        while machine.boots == boots:  # noqa: ASYNC110  (the fleet's task counts the boots)
            await trio.sleep(0.2)

        def back(rows: dict[str, NodeRow], members: list[Member]) -> bool:
            # A heartbeat since the reset: the curator's health alone lags.
            row = rows.get(real.machines.address(index))
            beat = row.since_heartbeat if row is not None else None
            return (
                _healthy(row)
                and beat is not None
                and beat < trio.current_time() - reset_at
                and any(m.id == member.id and not m.is_learner for m in members)
            )

        await _until(real, back)
        progress(
            "%s: back by itself from its disk: node %s healthy, etcd member %x a voter again",
            real.provider_id(index), before.node_id, member.id,
        )  # fmt: skip
        if len(consensus) > 1:
            other = real.machines.system_url(consensus[1])
            await redfish.reset(other, credentials, "ForceOff")
            while await redfish.power_state(other, credentials) != PowerState.OFF:  # noqa: ASYNC110
                await trio.sleep(0.2)
            with trio.fail_after(30):
                async with Client(real.first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
                    await etcd.put(b"/demo/quorum", b"two of three voters")
            progress(
                "%s off: etcd still takes writes, so %s votes; powering it on again",
                real.provider_id(consensus[1]), real.provider_id(index),
            )  # fmt: skip
            await redfish.reset(other, credentials, "On")
            address = real.machines.address(consensus[1])
            await _until(real, lambda rows, _: _healthy(rows.get(address)))
            progress("%s: back and healthy", real.provider_id(consensus[1]))


def _hex(image: Path) -> str:
    return image.name.removesuffix(".pyz")


async def _upgrade(real: RealFleet, image: Path) -> bool:
    """Upgrade every machine to ``image`` (``shepherd upgrade``'s run, the
    Shepherd's upgrader); whether every one was upgraded."""
    real.start_upgrader(real.first.access)
    options = UpgradeOptions(
        real.bmdb_url,
        "start",
        image=image_from_server(real.images, f"sha256:{_hex(image)}", plain_http=True),
        ssl_context=ssl.create_default_context(),
        machines=tuple(real.ids),
        owner=real.first.access,
        operator=getpass.getuser(),
        reason="bin/demo --real-machines --upgrade",
    )
    planned = await create_run(real.conn, options)
    if planned.run is None:
        logger.error("no upgrade run: %s", "; ".join(str(c.left_out) for c in planned.choices))
        return False
    names = {m: real.provider_id(i) for i, m in enumerate(real.ids)}
    progress(
        "upgrade requested (shepherd upgrade --all): %d machines to sha256:%s, each writing "
        "it to its other slot at once, then booted into it: the worker first, then the "
        "consensus members one at a time",
        len(real.ids), _hex(image)[:12],
    )  # fmt: skip
    run_id = planned.run.run_id
    seen: dict[uuid.UUID, tuple[object, ...]] = {}
    while True:
        run = await real.conn.transact(lambda q: q.upgrade_run(run_id))
        machines = await real.conn.transact(lambda q: q.upgrade_machines(run_id))
        for m, _ in machines:
            now = (m.state, m.agent_state, m.slot)
            if seen.get(m.machine_id) != now:
                seen[m.machine_id] = now
                progress("%s: %s", names.get(m.machine_id, m.machine_id), _upgrade_line(m))
        assert run is not None
        if run.finished_at is not None:
            if run.stop_cause:
                logger.error("the upgrade stopped: %s", run.stop_cause)
                return False
            progress("every node runs sha256:%s from its slot B, permanent", _hex(image)[:12])
            return True
        await trio.sleep(0.5)


def _upgrade_line(m: MachineUpgrade) -> str:
    if m.state == "upgraded":
        return f"upgraded: slot {m.slot} runs {m.running_digest}, healthy"
    if m.agent_state:
        return f"{m.state}; its agent: {m.agent_state}: {m.agent_detail or ''}".rstrip(": ")
    return f"{m.state}{': ' + m.detail if m.detail else ''}"


async def _decommission(real: RealFleet, index: int) -> None:
    await act(
        real.conn, "decommission", real.ids[index],
        operator=getpass.getuser(), reason="bin/demo --real-machines",
    )  # fmt: skip
    progress("%s: decommission requested", real.provider_id(index))
    while True:
        got = await overview.machine(real.conn, real.ids[index])
        if got is not None and got.decommission and got.decommission.startswith("decommissioned"):
            break
        await trio.sleep(0.5)
    progress("%s: %s", real.provider_id(index), got.decommission)


async def _until_reported(real: RealFleet) -> list[OSInstallation]:
    while True:
        got = [await real.installation(i) for i in range(len(real.ids))]
        if all(g is not None and g.reported for g in got):
            return [g for g in got if g is not None]
        await trio.sleep(0.3)


async def _nodes(real: RealFleet) -> dict[str, NodeRow]:
    try:
        async with real.first.access.open() as owner:
            return {row.address: row for row in await owner.nodes() if row.address}
    except MetropolisError as e:
        logger.debug("the curators did not answer: %s", e)
        return {}


async def _members(real: RealFleet) -> list[Member]:
    try:
        async with Client(real.first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
            found: list[Member] = await etcd.member_list()
            return found
    except MetropolisError as e:
        logger.debug("etcd did not answer: %s", e)
        return []


async def _until(
    real: RealFleet, check: Callable[[dict[str, NodeRow], list[Member]], bool]
) -> None:
    while not check(await _nodes(real), await _members(real)):  # noqa: ASYNC110
        await trio.sleep(0.5)


def _healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


def _voter(members: list[Member], node_id: str) -> bool:
    return any(m.name == node_id and not m.is_learner for m in members)


async def _table(real: RealFleet) -> str:
    rows = [
        ("MACHINE", "ADDRESS", "DISK", "INSTALL", "NODE", "ROLES", "HEALTH", "ETCD", "IMAGE",
         "SLOT"),
    ]  # fmt: skip
    nodes = await _nodes(real)
    members = {m.name: m for m in await _members(real)}

    def node_cells(row: NodeRow | None) -> tuple[str, str, str, str, str, str]:
        if row is None:
            return "-", "-", "-", "-", "-", "-"
        member = members.get(row.node_id)
        etcd = "-" if member is None else ("learner" if member.is_learner else "voter")
        health = row.health if row.state == "UP" else f"{row.health} ({row.state})"
        return (
            row.node_id, ",".join(row.roles) or "-", health, etcd, row.short_image,
            row.slot_state,
        )  # fmt: skip

    rows.append(
        ("first-node", real.first.address, "-", "-", *node_cells(nodes.get(real.first.address)))
    )
    for index in range(len(real.ids)):
        got = await real.installation(index)
        detail = await overview.machine(real.conn, real.ids[index])
        install = "-" if got is None else f"{got.state}@{got.generation}"
        if detail is not None and detail.decommission:
            install = (
                "decommissioned (wiped)" if "decommissioned" in detail.decommission else install
            )
        address = real.machines.address(index)
        rows.append(
            (real.provider_id(index), address, real.root_device(index), install,
             *node_cells(nodes.get(address)))
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
