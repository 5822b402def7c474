"""The Shepherd's whole path on real machines: nspawn machines to cluster nodes.

For ``bin/demo --real-machines``, ``bench/install.py --real-machines`` and
the tests on real machines. ``open_real_fleet`` brings up, under a folder:

    machines          `shepherd.nspawn.open_fleet`: N systemd-nspawn machines,
                      each with its own NIC on the fleet's bridge, a loop-device
                      disk and power through the fleet's Redfish BMC
    machines.toml     the static provider's list: each machine's address (port
                      22) and its BMC's system URL; the BMC's credentials in
                      bmc.toml (0600) beside it
    image server      the node image, on the host's bridge address
    agent server      the agent callback, on the host's bridge address
    first node        a cluster bootstrapped on the host's bridge address (the
                      nodes' fixed ports): the machines' nodes register into it
    control loops     initializer (SSH as root, the agent as a systemd unit of
                      the machine, `AgentConfig.systemd_unit`, installing real
                      disks with ``layout``), decommissioner (the owner's
                      credentials: it removes a machine's node from the cluster
                      before the wipe), and the approver

and yields once every machine's agent has sent its hardware report. Every
server listens on the bridge (or the host's loopback: PostgreSQL, the BMC),
so nothing is reachable from beyond this host.

Rolling upgrades need the cluster's owner credentials, which only a cluster
built on the fleet gives: `RealFleet.start_upgrader` adds the Shepherd's
upgrader (`shepherd.upgrader`) to the loops once there is one, and
`RealFleet.shepherd_argv` is the command line of a whole second Shepherd
(``python -m shepherd``, a process of its own that a test can kill) on the
same BMDB, provider files and agent server.

`RealFleet.request` asks machines to install as ``shepherd install`` does
(the root device as the hardware report names the machine's disk: its
loop device's kernel name). Leaving the block stops everything in order,
shielded: the loops, the servers, the first node, then the machines (each
powered off; their loop devices detached, the bridge and namespaces
removed, `shepherd.nspawn.fleet`). Needs root, systemd-nspawn, mmdebstrap
(first build of the machines' root), PostgreSQL for ``bmdb_url``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

import bmdb
from bmdb.model import OSInstallation, Queries
from metropolis.owner import OwnerAccess
from metropolis.proto import parameters
from shepherd.agent.gpt import Layout
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.agent_server.server import port_of
from shepherd.agent_start import AgentConfig
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.decommissioner import Decommissioner
from shepherd.initializer import Initializer
from shepherd.install import Decision, Plan, image_from_server, install, owner_public_key
from shepherd.localcluster import FirstNode, open_first_node
from shepherd.nspawn.fleet import Fleet, open_fleet
from shepherd.providers.redfish import load_credentials
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import load_or_create_ssh_key
from shepherd.upgrader import UPGRADE_WORKERS, Upgrader

__all__ = ["AGENT_PATH", "SMALL_LAYOUT", "RealFleet", "open_real_fleet"]

logger = logging.getLogger("shepherd.realfleet")

#: Where the agent is uploaded on each machine.
AGENT_PATH = "/root/agent"

#: A layout for small test disks: the node image (about 15 MiB) fits a
#: system slot, and the data partition holds etcd's 64 MiB WAL segment.
SMALL_LAYOUT = Layout(boot_mib=4, system_mib=24, data_min_mib=160)


@dataclass
class RealFleet:
    """The running parts of `open_real_fleet`."""

    folder: Path
    machines: Fleet
    conn: bmdb.Connection
    provider: StaticProvider
    config: AgentConfig
    ssh: SSHClient
    ssh_key_file: Path
    first: FirstNode
    #: The image server's ``http://host:port`` and the image's SHA-256.
    images: str
    image_sha256: str
    layout: Layout
    #: The cluster's info (``metropolis owner info --out`` writes the same).
    cluster_file: Path
    bmdb_url: str
    #: The nursery of the loops (`start_upgrader` adds one to it).
    nursery: trio.Nursery
    #: Machine ids, in fleet order.
    ids: list[uuid.UUID] = field(default_factory=list)

    def start_upgrader(
        self, owner: OwnerAccess, *, poll: float = 0.5, stage_allowance: float = 300.0
    ) -> None:
        """Run the Shepherd's upgrader with ``owner``'s credentials among the
        fleet's loops, until the fleet stops."""
        start_control_loop(
            self.nursery,
            self.conn,
            Upgrader(owner, poll=poll, stage_allowance=stage_allowance),
            parallelism=UPGRADE_WORKERS,
            limiter=RateLimiter(Rate(interval=0.01, burst=UPGRADE_WORKERS)),
        )

    def shepherd_argv(self, cluster_info: Path, owner_key: Path) -> list[str]:
        """``python -m shepherd`` for a second Shepherd of this fleet, with the
        owner's credentials (``--cluster-owner-info``, ``--cluster-owner-key``):
        its upgrader moves upgrade runs; its other loops find nothing to do
        that this one's do not (the BMDB's work locks keep them apart)."""
        c = self.config
        return [
            sys.executable, "-m", "shepherd", "--bmdb-url", self.bmdb_url,
            "--provider", "static",
            "--static-machines-path", str(self.folder / "machines.toml"),
            "--static-bmc-credentials-path", str(self.folder / "bmc.toml"),
            "--ssh-key-path", str(self.ssh_key_file),
            "--agent-endpoint", c.endpoint, "--agent-systemd-unit",
            "--agent-heartbeat-interval", f"{c.heartbeat_interval:g}s",
            "--agent-heartbeat-backoff-cap", f"{c.heartbeat_backoff_cap:g}s",
            "--cluster-owner-info", str(cluster_info),
            "--cluster-owner-key", str(owner_key),
        ]  # fmt: skip

    def provider_id(self, index: int) -> str:
        return self.machines.system_id(index)

    def root_device(self, index: int) -> str:
        """Machine ``index``'s disk as its hardware report names it."""
        return self.machines.disks[index].name

    async def plan(self, *, reinstall: bool = False, root_device: str | None = None) -> Plan:
        """Register into the first node's cluster, the image from our server."""
        async with self.first.access.open() as owner:
            ticket = await owner.ticket()
        key = owner_public_key(self.first.owner_key.read_bytes(), str(self.first.owner_key))
        params = parameters.register_parameters(self.first.info, ticket, key)
        return Plan(
            node_parameters=parameters.encode(params),
            image=image_from_server(self.images, f"sha256:{self.image_sha256}", plain_http=True),
            root_device=root_device or self.root_device(0),
            reinstall=reinstall,
        )

    async def request(self, indexes: Sequence[int], *, reinstall: bool = False) -> list[Decision]:
        """Ask machines ``indexes`` to install onto their disk (each names
        its own loop device), as ``shepherd install`` does: one ticket, a
        request each."""
        plan = await self.plan(reinstall=reinstall)
        decisions = []
        for index in indexes:
            mine = dataclasses.replace(plan, root_device=self.root_device(index))
            decisions += await install(self.conn, mine, machines=[self.ids[index]])
        return decisions

    async def installation(self, index: int) -> OSInstallation | None:
        machine_id = self.ids[index]

        async def body(q: Queries) -> OSInstallation | None:
            return await q.os_installation(machine_id)

        return await self.conn.transact(body)


def _write_provider_files(folder: Path, machines: Fleet) -> tuple[Path, Path]:
    """machines.toml (addresses, BMC URLs) and bmc.toml (0600, credentials)."""
    entries = "".join(
        f'\n[[machine]]\nid = "{machines.system_id(i)}"\naddress = "{machines.address(i)}"\n'
        f'port = 22\nlocation = "nspawn"\nbmc = "{machines.system_url(i)}"\n'
        for i in range(len(machines.machines))
    )
    listing = folder / "machines.toml"
    listing.write_text("# The nspawn machines, as the static provider reads them.\n" + entries)
    credentials = folder / "bmc.toml"
    credentials.touch(mode=0o600)
    credentials.chmod(0o600)
    credentials.write_text(
        f'[default]\nusername = "{machines.bmc_username}"\npassword = "{machines.bmc_password}"\n'
    )
    return listing, credentials


@asynccontextmanager
async def open_real_fleet(
    folder: Path,
    *,
    bmdb_url: str,
    count: int,
    image: Path,
    layout: Layout = SMALL_LAYOUT,
    disk_size: int | Sequence[int] = 256 << 20,
    heartbeat_interval: float = 1.0,
    approve: bool = True,
    approve_interval: float = 0.5,
    decommission: bool = True,
    within: float = 180.0,
) -> AsyncIterator[RealFleet]:
    """Bring the whole path up under ``folder`` (see the module); yield once
    every machine is taken over and reported its hardware, within ``within``
    seconds (else `trio.TooSlowError`). Needs a trio-asyncio loop (SSH).
    ``folder`` must be short: the first node's etcd socket lies under it."""
    await trio.to_thread.run_sync(lambda: folder.mkdir(parents=True, exist_ok=True))
    key = load_or_create_ssh_key(folder / "shepherd_ed25519")
    async with (
        open_fleet(
            folder / "machines",
            count=count,
            authorized_keys=[key.authorized_key],
            disk_size=disk_size,
        ) as machines,  # fmt: skip
        bmdb.open_connection(bmdb_url, migrate=True) as conn,
        open_first_node(
            folder / "first",
            machines.host_address,
            folder / "owner.pem",
            folder / "first.log",
        ) as first,
        trio.open_nursery() as nursery,
    ):
        listing, credentials = _write_provider_files(folder, machines)
        provider = StaticProvider.from_file(listing, credentials=load_credentials(credentials))
        await sync_provided(conn, provider)
        host = machines.host_address
        images = await nursery.start(serve_images, ImageServerConfig(f"{host}:0", image.parent))
        binds = await nursery.start(
            lambda task_status: run_agent_server(
                conn, AgentServerConfig(listen=f"{host}:0"), task_status=task_status
            )
        )
        config = AgentConfig(
            executable=agent_zipapp(),
            target_path=AGENT_PATH,
            endpoint=f"http://{host}:{port_of(binds[0])}",
            endpoint_ca_certificate=b"",
            ssh_connect_timeout=10.0,
            ssh_exec_timeout=60.0,
            heartbeat_interval=heartbeat_interval,
            heartbeat_backoff_cap=4.0,
            install_layout=(layout.boot_mib, layout.system_mib, layout.data_min_mib),
            systemd_unit=True,
        )
        ssh = SSHClient(key, username="root", connect_timeout=config.ssh_connect_timeout)
        limiter = RateLimiter(Rate(interval=0.01, burst=count))
        start_control_loop(
            nursery,
            conn,
            Initializer(provider, ssh, config),
            parallelism=min(count, 8),
            limiter=limiter,
        )
        if decommission:
            decommissioner = Decommissioner(
                provider, ssh, agent_target_path=AGENT_PATH, owner=first.access,
                backoff=bmdb.Backoff(initial=2, maximum=10, exponent=2),
            )  # fmt: skip
            start_control_loop(nursery, conn, decommissioner, parallelism=2, limiter=limiter)
        if approve:
            nursery.start_soon(run_approver, first.access, conn, approve_interval)
        real = RealFleet(
            folder=folder,
            machines=machines,
            conn=conn,
            provider=provider,
            config=config,
            ssh=ssh,
            ssh_key_file=folder / "shepherd_ed25519",
            first=first,
            images=images,
            image_sha256=image.name.removesuffix(".pyz"),
            layout=layout,
            cluster_file=folder / "cluster.pb",
            bmdb_url=bmdb_url,
            nursery=nursery,
        )
        real.cluster_file.write_bytes(bytes(first.info))
        with trio.fail_after(within):
            real.ids = await _taken_over(conn, [real.provider_id(i) for i in range(count)])
        logger.info("%d machines taken over, each reported its hardware", count)
        try:
            yield real
        finally:
            nursery.cancel_scope.cancel()


async def _taken_over(conn: bmdb.Connection, provider_ids: list[str]) -> list[uuid.UUID]:
    """The machine ids of ``provider_ids`` once each has a hardware report."""
    while True:
        rows = await conn.transact(lambda q: q.machines())
        found = {r.provided.provider_id: r for r in rows if r.provided is not None}
        if all(p in found and found[p].has_hardware_report for p in provider_ids):
            return [found[p].machine_id for p in provider_ids]
        await trio.sleep(0.2)
