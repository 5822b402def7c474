"""Rolling upgrades on real machines: five nspawn machines, a cluster of their nodes.

One run of `shepherd.realfleet` for the module (`real_thread.RealThread`):
five Debian machines (systemd, a NIC of their own, a loop-device disk, power
through a Redfish BMC), taken over, installed with the session's node image
and approved by the Shepherd's loops. Machines 0-2 become the cluster's
consensus members and the first node (on the host, the cluster's
bootstrap) gives its own role up, so etcd has three voters, all on
machines; machines 3 and 4 are workers. A second Shepherd, a process of
its own (``python -m shepherd`` with the owner's credentials,
`RealFleet.shepherd_argv`), runs the upgrader; each run is started with
``python -m shepherd upgrade``. The images: the session's, a second
release of it (`metropolis.image.variant`: another digest, so the boot
unpacks it anew as a new release) and a broken one whose node
exits at once. The tests build on each other, in file order (one xdist
group):

* a run to the broken image: every machine writes its other slot at the
  run's start, the first worker is activated and boots it once, its node
  never comes up, the boot check gives up and reboots, the old slot boots;
  the run stops with that cause, no other machine was activated, the node
  says which image it went back from and why;
* a run to the second image, its power cut through the BMC halfway through
  the slot write (`realdisk.PAUSE_DIR`'s ``image-half``): the old slot
  boots (the new one was never pointed at), the agent reports the
  generation interrupted, the run stops saying so before any activation;
* the whole cluster moved to the second image while a client writes
  through the curators (`Writer`), with the Shepherd killed (SIGKILL) while
  a consensus member is being upgraded and started again: every machine
  upgraded once, in order (workers, then members one at a time, the
  leader's node last), never two nodes down at once, no write lost, no
  write refused for longer than one leader election (the curator's lease,
  `metropolis.curator.settings.DEFAULT_TTL`), and each slot permanent.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb.model import MachineUpgrade, Queries, UpgradeRun, UpgradeState
from metropolis.curator.settings import DEFAULT_TTL
from metropolis.errors import MetropolisError
from metropolis.image.variant import release_variant
from metropolis.owner import NodeRow, Owner, OwnerAccess
from metropolis.proto import management as m
from metropolis.rpc import methods
from metropolis.rpc.client import endpoints_from_directory
from shepherd.agent import realdisk
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import Credentials, RedfishClient
from tests.fixtures.image import broken_image
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible
from tests.shepherd.nspawn.real_thread import RealThread

MACHINES = 5
MEMBERS = (0, 1, 2)
WORKERS = (3, 4)
#: Bound on each wait for the cluster (a node's start, a vote, a report).
BOUND = 240.0
#: Bound on a whole run of five machines.
RUN_BOUND = 900.0
#: A node of the new image has this long from its boot to be healthy.
HEALTH_TIMEOUT = 180
#: The broken image's try is given up this long after its boot.
BROKEN_HEALTH_TIMEOUT = 20


@dataclass
class Images:
    folder: Path
    first: Path
    second: Path
    broken: Path

    @staticmethod
    def digest(path: Path) -> str:
        return "sha256:" + path.name.removesuffix(".pyz")


@dataclass
class Upgrades:
    """The module's rig: the machines, the images, the owner's way to the
    members' curators, and the second Shepherd's process."""

    rig: RealThread
    images: Images
    #: The cluster file listing the members' curators (``owner info --out``'s).
    info: Path = Path()
    access: OwnerAccess | None = None
    shepherd: subprocess.Popen[bytes] | None = None
    shepherds: int = 0
    #: The first test made the cluster and started the second Shepherd.
    ready: bool = False

    def require(self) -> None:
        """Fail at once, not at a bound, when the first test did not finish."""
        if not self.ready:
            pytest.fail("the module's cluster is not set up: its first test failed")

    @property
    def owner(self) -> OwnerAccess:
        assert self.access is not None
        return self.access

    def start_shepherd(self) -> None:
        real = self.rig.fleet
        self.shepherds += 1
        log = open(real.folder / f"shepherd-{self.shepherds}.log", "wb")  # noqa: SIM115
        self.shepherd = subprocess.Popen(
            real.shepherd_argv(self.info, real.first.owner_key),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def kill_shepherd(self) -> None:
        """SIGKILL: no cleanup, its BMDB session and work locks left to expire."""
        if self.shepherd is not None and self.shepherd.poll() is None:
            self.shepherd.kill()
            self.shepherd.wait()
        self.shepherd = None

    def stop_shepherd(self) -> None:
        if self.shepherd is not None and self.shepherd.poll() is None:
            self.shepherd.send_signal(signal.SIGTERM)
            try:
                self.shepherd.wait(30)
            except subprocess.TimeoutExpired:
                self.shepherd.kill()
                self.shepherd.wait()
        self.shepherd = None

    def upgrade_argv(self, image: Path, *more: str) -> list[str]:
        real = self.rig.fleet
        return [
            sys.executable, "-m", "shepherd", "upgrade", "--bmdb-url", self.rig.bmdb_url,
            "--image-server", real.images, "--image-digest", Images.digest(image),
            "--insecure-plain-http", "--cluster-owner-info", str(self.info),
            "--cluster-owner-key", str(real.first.owner_key), "--reason", "test", *more,
        ]  # fmt: skip


@pytest.fixture(scope="module")
def upgrades(module_bmdb_url: str, node_image: Path) -> Iterator[Upgrades]:
    skip_unless_possible()
    folder = Path(tempfile.mkdtemp(prefix="ru-", dir="/tmp"))  # short: etcd's socket
    served = folder / "images"
    served.mkdir()
    first = served / node_image.name
    first.write_bytes(node_image.read_bytes())
    images = Images(
        served,
        first,
        release_variant(first, "test_real_upgrade: the second release", served),
        broken_image(served),
    )
    thread = RealThread(folder, module_bmdb_url, first, MACHINES)
    thread.start()
    state = Upgrades(thread, images)
    try:
        yield state
    finally:
        try:
            state.stop_shepherd()
        finally:
            thread.stop()
            subprocess.run(["rm", "-rf", str(folder)], check=False)


async def until(check: Callable[[], Awaitable[bool]], within: float = BOUND) -> None:
    with trio.fail_after(within):
        while not await check():  # noqa: ASYNC110
            await trio.sleep(0.5)


async def cli(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    with trio.fail_after(RUN_BOUND):  # --wait follows a run until it ends
        done = await trio.run_process(
            list(argv), capture_stdout=True, capture_stderr=True, check=False
        )
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode in ok, (argv, done.returncode, out)
    return out


async def rows_of(access: OwnerAccess) -> list[NodeRow]:
    """The cluster's node table, or [] while no curator answers (a failover)."""
    try:
        with trio.fail_after(20):
            async with access.open() as owner:
                return await owner.nodes()
    except (MetropolisError, trio.TooSlowError, OSError):
        return []


def healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


def by_address(rows: list[NodeRow]) -> dict[str, NodeRow]:
    return {r.address: r for r in rows if r.address}


async def run_state(url: str) -> tuple[UpgradeRun | None, list[MachineUpgrade]]:
    async with bmdb.open_connection(url) as conn:

        async def body(q: Queries) -> tuple[UpgradeRun | None, list[MachineUpgrade]]:
            runs = await q.upgrade_runs(1)
            if not runs:
                return None, []
            return runs[0], [mu for mu, _ in await q.upgrade_machines(runs[0].run_id)]

        return await conn.transact(body)


async def run_ended(url: str, run_id: uuid.UUID | None = None) -> UpgradeRun:
    found: UpgradeRun | None = None

    async def ended() -> bool:
        nonlocal found
        found, _ = await run_state(url)
        return (
            found is not None
            and (run_id is None or found.run_id == run_id)
            and (found.finished_at is not None)
        )

    await until(ended, RUN_BOUND)
    assert found is not None
    return found


async def cut_power(upgrades: Upgrades, index: int) -> None:
    """ForceOff through the machine's BMC, then On."""
    real = upgrades.rig.fleet
    url = real.machines.system_url(index)
    credentials = Credentials(real.machines.bmc_username, real.machines.bmc_password)
    async with RedfishClient() as redfish:
        await redfish.reset(url, credentials, "ForceOff")
        with trio.fail_after(BOUND):
            while await redfish.power_state(url, credentials) != PowerState.OFF:  # noqa: ASYNC110
                await trio.sleep(0.1)
        await redfish.reset(url, credentials, "On")


async def test_five_machines_make_three_members_and_two_workers(upgrades: Upgrades) -> None:
    rig = upgrades.rig
    real = rig.fleet
    async with real.first.access.open() as owner:
        ticket = (await owner.ticket()).hex()
    for index in range(MACHINES):
        out = await cli(*rig.install_argv(index, ticket))
        assert "1 requested" in out, out
    addresses = [real.machines.address(i) for i in range(MACHINES)]

    async def all_healthy() -> bool:
        rows = by_address(await rows_of(real.first.access))
        return all(healthy(rows.get(a)) for a in addresses)

    await until(all_healthy)
    owner_cli = (
        *(sys.executable, "-m", "metropolis", "owner", "--root", str(real.first.root.path)),
        *("--owner-key", str(real.first.owner_key)),
    )
    rows = by_address(await rows_of(real.first.access))
    for index in MEMBERS:
        await cli(
            *owner_cli, "set-roles", rows[addresses[index]].node_id, "--consensus-member", "on"
        )

    async def voters() -> bool:
        got = by_address(await rows_of(real.first.access))
        return all(got[addresses[i]].etcd == "voter" for i in MEMBERS)

    await until(voters)
    # The members' curators, as the owner reaches them once the first node
    # gives its role up (its curator stops with it).
    members = [rows[addresses[i]] for i in MEMBERS]
    keys = {r.public_key for r in members}
    info = None

    async def curators_listed() -> bool:
        # A member's curator joins the cluster directory once it runs,
        # which may be after its etcd votes.
        nonlocal info
        async with real.first.access.open() as owner:
            info = await owner.info()
        directory = info.cluster_directory
        return directory is not None and keys <= {n.public_key for n in directory.nodes}

    await until(curators_listed)
    assert info is not None and info.cluster_directory is not None
    info.cluster_directory.nodes = [n for n in info.cluster_directory.nodes if n.public_key in keys]
    assert len(info.cluster_directory.nodes) == len(MEMBERS)
    upgrades.info = real.folder / "members.pb"
    upgrades.info.write_bytes(bytes(info))
    upgrades.access = dataclasses.replace(
        real.first.access, endpoints=endpoints_from_directory(info.cluster_directory)
    )
    first = by_address(await rows_of(real.first.access))[real.first.address]
    # Through the members' curators: the first node's stops as it gives its
    # role up, and set_roles reads the table back after its write.
    async with upgrades.owner.open() as owner:
        await owner.set_roles(first.node_id, consensus_member=False)

    async def three_voters_on_machines() -> bool:
        got = await rows_of(upgrades.owner)
        table = by_address(got)
        leader = [r for r in got if r.leader]
        return (
            sorted(r.address for r in got if r.etcd == "voter") == sorted(a for a in addresses[:3])
            and table.get(real.first.address) is not None
            and table[real.first.address].etcd == "none"
            and "ConsensusMember" not in table[real.first.address].roles
            and len(leader) == 1
            and leader[0].address in addresses[:3]
            and all(healthy(table.get(a)) for a in addresses)
        )

    await until(three_voters_on_machines)
    upgrades.start_shepherd()
    upgrades.ready = True
    # Every node runs the session's image from slot A, permanent.
    for row in await rows_of(upgrades.owner):
        if row.address in addresses:
            assert (row.image, row.slot, row.trial) == (
                Images.digest(upgrades.images.first),
                "A",
                False,
            )


async def test_an_image_whose_node_cannot_start_goes_back_and_stops_the_run(
    upgrades: Upgrades,
) -> None:
    upgrades.require()
    rig, images = upgrades.rig, upgrades.images
    real = rig.fleet
    broken = Images.digest(images.broken)
    before = {r.node_id: r for r in await rows_of(upgrades.owner)}
    out = await cli(
        *upgrades.upgrade_argv(
            images.broken, "--all", "--health-timeout", str(BROKEN_HEALTH_TIMEOUT), "--wait"
        ),
        ok=(1,),
    )
    run, machines = await run_state(rig.bmdb_url)
    assert run is not None and run.finished_at is not None
    back = [mu for mu in machines if mu.state is UpgradeState.ROLLED_BACK]
    assert len(back) == 1, machines
    index = real.ids.index(back[0].machine_id)
    assert index in WORKERS  # workers go first
    assert run.stop_cause is not None and str(back[0].machine_id) in run.stop_cause
    assert "rolled-back" in out and "not confirmed healthy" in out, out
    # Every machine wrote the image at the run's start (the broken node
    # only fails to start), but no other went down: the other worker and
    # the members wait, written, never activated.
    assert {mu.state for mu in machines if mu is not back[0]} == {UpgradeState.PENDING}
    assert all(mu.requested_at is None for mu in machines if mu is not back[0])
    assert {mu.agent_state for mu in machines if mu is not back[0]} == {"written"}
    # The node is back on slot A, healthy, and says which image it left and why.
    address = real.machines.address(index)

    async def back_healthy() -> bool:
        row = by_address(await rows_of(upgrades.owner)).get(address)
        return healthy(row) and row is not None and row.rolled_back == broken

    await until(back_healthy)
    row = by_address(await rows_of(upgrades.owner))[address]
    assert (row.image, row.slot, row.trial) == (Images.digest(images.first), "A", False)
    assert "not confirmed healthy" in row.rollback_cause
    assert row.node_id in before  # the same node, with its data
    # The cluster is as it was: the members are the same voters.
    after = {r.node_id: r for r in await rows_of(upgrades.owner)}
    assert {n for n, r in after.items() if r.etcd == "voter"} == {
        n for n, r in before.items() if r.etcd == "voter"
    }
    shown = await cli(sys.executable, "-m", "bmdb", "--url", rig.bmdb_url, "machines")
    line = next(x for x in shown.splitlines() if str(real.ids[index]) in x)
    assert " rolled-back " in line and " A " in line, line


async def test_a_power_cut_in_the_middle_of_the_slot_write_boots_the_old_slot(
    upgrades: Upgrades,
) -> None:
    upgrades.require()
    rig, images = upgrades.rig, upgrades.images
    real = rig.fleet
    index = WORKERS[1]
    address = real.machines.address(index)
    await rig.sh(
        index, f"mkdir -p {realdisk.PAUSE_DIR} && touch {realdisk.PAUSE_DIR}/pause-image-half"
    )
    await cli(
        *upgrades.upgrade_argv(images.second, "--machines", str(real.ids[index])),
    )

    async def paused() -> bool:
        found = await rig.sh(index, f"test -e {realdisk.PAUSE_DIR}/paused-image-half", check=False)
        return found.returncode == 0

    await until(paused)
    boots = real.machines.machines[index].boots
    await cut_power(upgrades, index)
    run = await run_ended(rig.bmdb_url)
    assert real.machines.machines[index].boots == boots + 1
    assert run.stop_cause is not None and "interrupted" in run.stop_cause, run
    _, machines = await run_state(rig.bmdb_url)
    (mu,) = machines
    assert mu.state is UpgradeState.FAILED and mu.agent_state == "failed", mu
    assert mu.requested_at is None, mu  # the write failed: never activated

    async def old_slot_healthy() -> bool:
        row = by_address(await rows_of(upgrades.owner)).get(address)
        return healthy(row)

    await until(old_slot_healthy)
    row = by_address(await rows_of(upgrades.owner))[address]
    assert (row.image, row.slot, row.trial) == (Images.digest(images.first), "A", False)


@dataclass
class Writer:
    """Writes through the curators all along: the first node's
    KubernetesController role toggled, each write read back.

    A write is *accepted* when UpdateNodeRoles answers; it is *lost* if a
    read after it (GetNodes at the leading curator) shows the other value.
    A write that fails leaves the value unknown until the next accepted one.
    *Refused*: from a failed write to the next accepted one, each window
    with its length and the errors seen.
    """

    access: OwnerAccess
    key: bytes
    accepted: int = 0
    lost: list[str] = field(default_factory=list)
    refused: list[tuple[float, float, str]] = field(default_factory=list)
    expected: bool | None = None
    _refused_since: float | None = None
    _errors: list[str] = field(default_factory=list)

    def _ok(self) -> None:
        now = trio.current_time()
        if self._refused_since is not None:
            self.refused.append((self._refused_since, now, "; ".join(self._errors[-3:])))
            self._refused_since = None
            self._errors = []

    def _failed(self, error: BaseException) -> None:
        if self._refused_since is None:
            self._refused_since = trio.current_time()
        self._errors.append(f"{type(error).__name__}: {error}"[:200])
        self.expected = None

    async def run(self) -> None:
        want = True
        while True:
            try:
                async with self.access.open() as owner:
                    while True:
                        # Unknown while a write is in flight (it may be
                        # applied and its answer lost to a cancellation).
                        self.expected = None
                        with trio.fail_after(DEFAULT_TTL):
                            await owner.client.unary(
                                methods.UPDATE_NODE_ROLES,
                                m.UpdateNodeRolesRequest(
                                    pubkey=self.key, kubernetes_controller=want
                                ),
                            )
                        self.accepted += 1
                        self.expected = want
                        self._ok()
                        await self.check(owner, f"write #{self.accepted}")
                        want = not want
                        await trio.sleep(0.1)
            except (MetropolisError, OSError, trio.TooSlowError) as e:
                self._failed(e)
                await trio.sleep(0.1)

    async def check(self, owner: Owner, what: str) -> None:
        """Read the role back (a failed read is no write refused: skipped)."""
        expected = self.expected
        try:
            with trio.fail_after(DEFAULT_TTL):
                rows = await owner.nodes()
        except (MetropolisError, OSError, trio.TooSlowError):
            return
        row = next(r for r in rows if r.public_key == self.key)
        seen = "KubernetesController" in row.roles
        if expected is not None and seen != expected:
            self.lost.append(f"{what} ({expected}) read back as {seen}")

    async def check_once(self) -> None:
        """The last accepted write, read back after the run."""
        async with self.access.open() as owner:
            await self.check(owner, "the last write")

    def longest_refused(self) -> tuple[float, str]:
        return max(((end - start, why) for start, end, why in self.refused), default=(0.0, ""))


@dataclass
class Watch:
    """Samples of the run and the cluster until cancelled: the order machines
    were requested in, and the most nodes down at once (not UP and HEALTHY
    in the cluster's view, or with a machine requested)."""

    upgrades: Upgrades
    requested: list[uuid.UUID] = field(default_factory=list)
    most_requested: int = 0
    most_down: int = 0
    down_samples: list[list[str]] = field(default_factory=list)
    leaders: list[str] = field(default_factory=list)

    async def run(self) -> None:
        real = self.upgrades.rig.fleet
        machine_addresses = {real.machines.address(i) for i in range(MACHINES)}
        while True:
            _, machines = await run_state(self.upgrades.rig.bmdb_url)
            now = [mu.machine_id for mu in machines if mu.state is UpgradeState.REQUESTED]
            self.most_requested = max(self.most_requested, len(now))
            self.requested += [mid for mid in now if mid not in self.requested]
            rows = await rows_of(self.upgrades.owner)
            if rows:
                down = [
                    r.node_id for r in rows if r.address in machine_addresses and not healthy(r)
                ]
                if len(down) > self.most_down:
                    self.most_down = len(down)
                    self.down_samples.append(down)
                leader = next((r.node_id for r in rows if r.leader), "")
                if leader and (not self.leaders or self.leaders[-1] != leader):
                    self.leaders.append(leader)
            await trio.sleep(0.3)


@asynccontextmanager
async def running(*tasks: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(task)
        yield
        nursery.cancel_scope.cancel()


async def test_the_cluster_is_upgraded_under_writes_through_a_shepherd_killed_mid_run(
    upgrades: Upgrades,
) -> None:
    upgrades.require()
    rig, images = upgrades.rig, upgrades.images
    real = rig.fleet
    second = Images.digest(images.second)
    addresses = {real.machines.address(i): i for i in range(MACHINES)}
    before = {r.address: r for r in await rows_of(upgrades.owner) if r.address in addresses}
    first_key = by_address(await rows_of(upgrades.owner))[real.first.address].public_key
    writer = Writer(upgrades.owner, first_key)
    watch = Watch(upgrades)
    members = {real.ids[i] for i in MEMBERS}
    killed_at: MachineUpgrade | None = None
    async with running(writer.run, watch.run):
        await until(lambda: _accepted(writer))
        await cli(
            *upgrades.upgrade_argv(images.second, "--all", "--health-timeout", str(HEALTH_TIMEOUT))
        )

        async def a_member_being_upgraded() -> bool:
            nonlocal killed_at
            _, machines = await run_state(rig.bmdb_url)
            found = [
                mu
                for mu in machines
                if mu.machine_id in members
                and mu.state is UpgradeState.REQUESTED
                and mu.agent_state == "staged"
            ]
            killed_at = found[0] if found else None
            return killed_at is not None

        await until(a_member_being_upgraded, RUN_BOUND)
        upgrades.kill_shepherd()
        assert killed_at is not None
        # The machine goes on by itself: it reboots into the try, its node
        # comes up, the boot check keeps the slot, its agent says so; but
        # nothing records its end, nor starts the next one, while no
        # Shepherd runs.
        killed = killed_at.machine_id

        async def committed() -> bool:
            _, machines = await run_state(rig.bmdb_url)
            return any(mu.machine_id == killed and mu.agent_state == "committed" for mu in machines)

        await until(committed)
        _, machines = await run_state(rig.bmdb_url)
        assert [mu.state for mu in machines if mu.machine_id == killed] == [UpgradeState.REQUESTED]
        assert watch.most_requested == 1
        upgrades.start_shepherd()
        run = await run_ended(rig.bmdb_url)
    # The writer stopped (read back while it still wrote, the next write
    # could land between the read and the value it expects).
    await writer.check_once()
    assert killed_at is not None
    assert run.stop_cause is None, run.stop_cause
    _, machines = await run_state(rig.bmdb_url)
    assert {mu.machine_id: mu.state for mu in machines} == {
        mid: UpgradeState.UPGRADED for mid in real.ids
    }
    # Each machine was asked once in this run (a generation of its own, one
    # "starting" in its agent's log), the killed-at one too.
    for mu in machines:
        index = real.ids.index(mu.machine_id)
        log = (await rig.sh(index, "cat /root/agent.log")).stdout
        assert log.count(f"upgrade generation {mu.generation}: starting") == 1, (index, log)
    # The order: the workers, then the members one at a time, the leader's last.
    order = [real.ids.index(mid) for mid in watch.requested]
    assert sorted(order[:2]) == sorted(WORKERS), order
    assert sorted(order[2:]) == sorted(MEMBERS), order
    assert watch.most_down <= 1, watch.down_samples
    # Every node on the new image from slot B, permanent, healthy; the
    # members voters again; the same nodes as before.
    after = {r.address: r for r in await rows_of(upgrades.owner) if r.address in addresses}
    for address, row in after.items():
        assert healthy(row), row
        assert (row.image, row.slot, row.trial) == (second, "B", False), row
        assert row.node_id == before[address].node_id
        assert row.etcd == before[address].etcd
    # The writes: none lost, none refused for longer than one leader election.
    assert writer.accepted > 100
    assert writer.lost == []
    longest, why = writer.longest_refused()
    assert longest < DEFAULT_TTL, (longest, why, writer.refused)


async def _accepted(writer: Writer) -> bool:
    return writer.accepted > 0
