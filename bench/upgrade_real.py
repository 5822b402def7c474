"""``python -m bench.upgrade --real-machines``: a rolling upgrade of real machines
against the same machines' plain reboots, one at a time.

The machines are nspawn machines (`shepherd.nspawn`: systemd as PID 1, a NIC
of their own, a loop-device disk, a Redfish BMC) on `shepherd.realfleet`.
Setup, not timed: ``--machines`` machines (default 5) taken over, installed
and approved by the product; the first ``--consensus`` of them (default 3)
granted ConsensusMember, then the cluster's first node (on the host, its
bootstrap) gives its own role up, so that etcd's voters are all machines;
the others are workers. A writer then toggles the first node's
KubernetesController role through the members' curators (``UpdateNodeRoles``,
a leader-guarded etcd transaction) every 100 ms and reads each write back
(`bench.upgrade.writer`), until the end. Timed, in order:

- floor: each machine rebooted (``systemctl reboot`` over SSH), one after
  the other, each until its node is back as far as the upgrade asks of a
  node: it announced itself healthy after the boot (``/run/metropolis/
  healthy.json``: the cluster took its status, its roles run), and the
  owner's table shows it HEALTHY with a heartbeat after the reboot began.
  The sum of these.
- upgrade: a run of every machine to a second release of the image
  (`metropolis.image.variant`: another digest, so the boot unpacks it anew
  as a new release), written as ``shepherd upgrade`` writes it,
  moved by the Shepherd's upgrader (its control loop, in this process, with
  the members' curators as the owner's way in), until the run is finished:
  every node on the new image, healthy, its slot permanent.
- one leader election: the machine of the leading curator's node powered
  off through its BMC (then on again); the writer's refusal from then until
  a new leader takes its writes.

Prints both times and the ratio upgrade / floor (goal <= 1.5); the longest
refusal of a write during each phase, and the ratio of the upgrade's to
the election's (goal <= 1); writes lost (goal 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bench.ratios import report
from bench.upgrade import Writes, writer
from bmdb.localserver import LocalPostgres
from bmdb.model import Queries, UpgradeState
from metropolis.errors import MetropolisError
from metropolis.image.build import default_etcd
from metropolis.image.variant import release_variant
from metropolis.owner import NodeRow, OwnerAccess
from metropolis.rpc.client import endpoints_from_directory
from shepherd.demo_cluster import default_image_cache, node_image
from shepherd.install import image_from_server
from shepherd.providers.redfish import Credentials, RedfishClient
from shepherd.realfleet import RealFleet, open_real_fleet
from shepherd.upgrade import ask_writes, choose

DEFAULT_MACHINES = 5
DEFAULT_CONSENSUS = 3
#: The agents' heartbeat interval: the real-machines rig's (`shepherd.realfleet`).
HEARTBEAT_INTERVAL = 1.0
POLL = 0.25
#: A node of the new image has this long from its boot to be healthy.
HEALTH_TIMEOUT = 300


def say(line: str) -> None:
    print(line, flush=True)


def healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


async def rows_of(access: OwnerAccess) -> list[NodeRow]:
    try:
        with trio.fail_after(20):
            async with access.open() as owner:
                return await owner.nodes()
    except (MetropolisError, OSError, trio.TooSlowError):
        return []


async def _until(check: Callable[[], Awaitable[bool]], within: float) -> None:
    with trio.fail_after(within):
        while not await check():  # noqa: ASYNC110 (the cluster's state, polled)
            await trio.sleep(POLL)


async def ssh(real: RealFleet, index: int, command: str) -> tuple[int, str]:
    done = await trio.run_process(
        [
            "ssh", "-i", str(real.ssh_key_file), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
            f"root@{real.machines.address(index)}", command,
        ],
        capture_stdout=True, capture_stderr=True, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout.decode()


async def cluster(real: RealFleet, args: argparse.Namespace) -> OwnerAccess:
    """Install every machine, make the first ``--consensus`` members and take the
    first node's role away; the owner's access through the members' curators."""
    addresses = [real.machines.address(i) for i in range(args.machines)]
    await real.request(range(args.machines))

    async def all_healthy() -> bool:
        rows = {r.address: r for r in await rows_of(real.first.access)}
        return all(healthy(rows.get(a)) for a in addresses)

    await _until(all_healthy, args.timeout)
    rows = {r.address: r for r in await rows_of(real.first.access)}
    members = [rows[a] for a in addresses[: args.consensus]]
    async with real.first.access.open() as owner:
        for row in members:
            await owner.set_roles(row.node_id, consensus_member=True)
        info = await owner.info()
    assert info.cluster_directory is not None
    keys = {r.public_key for r in members}
    info.cluster_directory.nodes = [n for n in info.cluster_directory.nodes if n.public_key in keys]
    access = dataclasses.replace(
        real.first.access, endpoints=endpoints_from_directory(info.cluster_directory)
    )

    async def voting() -> bool:
        got = {r.address: r for r in await rows_of(access)}
        return all(
            got.get(r.address) is not None and got[r.address].etcd == "voter" for r in members
        )

    await _until(voting, args.timeout)
    first = rows[real.first.address]
    try:
        async with real.first.access.open() as owner:
            await owner.set_roles(first.node_id, consensus_member=False)
    except MetropolisError as e:  # it led, and resigned as it answered
        say(f"(the first node's answer to its role's end: {e})")

    async def machines_only() -> bool:
        got = await rows_of(access)
        table = {r.address: r for r in got}
        leads = [r.address for r in got if r.leader]
        return (
            sorted(r.address for r in got if r.etcd == "voter")
            == sorted(r.address for r in members)
            and leads != []
            and leads[0] in addresses
            and all(healthy(table.get(a)) for a in addresses)
        )

    await _until(machines_only, args.timeout)
    return access


async def reboot_until_back(real: RealFleet, access: OwnerAccess, index: int) -> float:
    """``systemctl reboot`` of machine ``index``, until its node is back (see the module)."""
    machine = real.machines.machines[index]
    address = real.machines.address(index)
    boots = machine.boots
    began = trio.current_time()
    await ssh(real, index, "systemctl reboot")
    while machine.boots == boots:  # noqa: ASYNC110 (the fleet's task counts boots)
        await trio.sleep(0.02)
    announced = False
    while True:
        if not announced:
            status, _ = await ssh(real, index, "test -e /run/metropolis/healthy.json")
            announced = status == 0
        if announced:
            row = next((r for r in await rows_of(access) if r.address == address), None)
            beat = row.since_heartbeat if row is not None else None
            if healthy(row) and beat is not None and beat < trio.current_time() - began:
                return trio.current_time() - began
        await trio.sleep(POLL)


async def upgrade_all(
    real: RealFleet, access: OwnerAccess, digest: str, args: argparse.Namespace
) -> tuple[float | None, str]:
    """The run of every machine to ``digest``; (seconds, how each machine went)."""
    image = image_from_server(real.images, digest, plain_http=True)
    view = await rows_of(access)
    began = trio.current_time()

    async def create(q: Queries) -> uuid.UUID:
        chosen = await choose(q, real.ids, digest, view)
        entries = [c.entry for c in chosen if c.entry is not None]
        run = await q.create_upgrade_run(
            image_digest=digest,
            os_image=bytes(image.message()),
            max_unavailable=1,
            health_timeout=HEALTH_TIMEOUT,
            requested_by="bench",
            machines=entries,
        )
        await ask_writes(q, run, entries)  # as `shepherd upgrade` does
        return run.run_id

    run_id = await real.conn.transact(create, isolation=bmdb.Isolation.SERIALIZABLE)
    # Where the time goes: when each machine was first seen written (its
    # agent's report), activated (requested) and done, from the command.
    seen: dict[tuple[uuid.UUID, str], float] = {}
    with trio.fail_after(args.timeout):
        while True:
            run = await real.conn.transact(lambda q: q.upgrade_run(run_id))
            assert run is not None
            now = trio.current_time() - began
            for m, _ in await real.conn.transact(lambda q: q.upgrade_machines(run_id)):
                for step, reached in (
                    ("written", m.agent_state is not None),
                    ("activated", m.requested_at is not None),
                    ("done", m.state.final),
                ):
                    if reached:
                        seen.setdefault((m.machine_id, step), now)
            if run.finished_at is not None:
                break
            await trio.sleep(POLL)
    took = trio.current_time() - began
    machines = await real.conn.transact(lambda q: q.upgrade_machines(run_id))

    def timeline(mid: uuid.UUID) -> str:
        at = {step: seen.get((mid, step)) for step in ("written", "activated", "done")}
        said = ", ".join(f"{step} +{t:.1f}s" for step, t in at.items() if t is not None)
        if at["activated"] is not None and at["done"] is not None:
            said += f" (down {at['done'] - at['activated']:.1f}s)"
        return said

    lines = "\n".join(
        f"  {real.provider_id(real.ids.index(m.machine_id))}: {m.state} "
        f"(phase {m.phase}) {m.detail or ''}; {timeline(m.machine_id)}"
        for m, _ in machines
    )
    if run.stop_cause or any(m.state is not UpgradeState.UPGRADED for m, _ in machines):
        return None, f"{lines}\n  stopped: {run.stop_cause}"
    return took, lines


async def election(real: RealFleet, access: OwnerAccess, writes: Writes) -> float | None:
    """Power off the leader's machine; the writer's refusal until a new leader takes writes."""
    rows = await rows_of(access)
    leader = next((r for r in rows if r.leader), None)
    addresses = [real.machines.address(i) for i in range(len(real.ids))]
    if leader is None or leader.address not in addresses:
        return None
    index = addresses.index(leader.address)
    url = real.machines.system_url(index)
    credentials = Credentials(real.machines.bmc_username, real.machines.bmc_password)
    writes.phase = "election"
    accepted = writes.accepted
    async with RedfishClient() as redfish:
        await redfish.reset(url, credentials, "ForceOff")
        cut = trio.current_time()
        with trio.move_on_after(120):
            # The writes after the cut taken by a new leader: the refusal ended.
            while not (writes.accepted > accepted + 2 and writes.last_ok_after(cut)):  # noqa: ASYNC110
                await trio.sleep(POLL)
        await redfish.reset(url, credentials, "On")
    return writes.longest_refusal("election")


async def main_async(args: argparse.Namespace, work: Path) -> int:
    built = await node_image(default_image_cache(), default_etcd())
    served = work / "images"
    served.mkdir()
    first_image = served / built.name
    shutil.copyfile(built, first_image)
    second = await trio.to_thread.run_sync(
        release_variant, first_image, "bench.upgrade: the second release", served
    )
    digest = "sha256:" + second.name.removesuffix(".pyz")
    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    postgres.create()
    postgres.start()
    writes = Writes()
    floor: float | None = None
    upgrade: float | None = None
    elected: float | None = None
    how = ""
    try:
        postgres.create_database("bench")
        async with (
            trio_asyncio.open_loop(),
            open_real_fleet(
                work / "r",
                bmdb_url=postgres.url("bench"),
                count=args.machines,
                image=first_image,
                heartbeat_interval=args.heartbeat_interval,
                decommission=False,
            ) as real,
            trio.open_nursery() as nursery,
        ):
            say(f"{args.machines} machines taken over; installing (setup)")
            access = await cluster(real, args)
            first_key = next(
                r.public_key for r in await rows_of(access) if r.address == real.first.address
            )
            nursery.start_soon(writer, access, first_key, writes)
            while writes.accepted < 3:  # noqa: ASYNC110 (the writer's progress)
                await trio.sleep(POLL)
            say("installed; members voting; the writer writes; measuring")

            writes.phase = "reboots"
            each = []
            for index in range(args.machines):
                with trio.fail_after(args.timeout):
                    each.append(await reboot_until_back(real, access, index))
            floor = sum(each)
            say(f"reboots, one at a time: {floor:.1f} s ({', '.join(f'{s:.1f}' for s in each)})")

            writes.phase = "upgrade"
            real.start_upgrader(access, poll=POLL)
            upgrade, how = await upgrade_all(real, access, digest, args)
            say(f"upgrade: {upgrade} s\n{how}")
            writes.phase = "after"
            elected = await election(real, access, writes)
            nursery.cancel_scope.cancel()
    finally:
        postgres.stop()
        shutil.rmtree(postgres.root, ignore_errors=True)
    print(
        f"\n{args.machines} real machines (nspawn; {args.consensus} consensus members, the "
        f"rest workers), agents' heartbeat every {args.heartbeat_interval:g} s, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'phase':<46} {'seconds':>8} {'longest refusal':>16} {'longest gap':>12}")
    for name, seconds, phase in (
        ("reboots, one at a time (the floor)", floor, "reboots"),
        ("rolling upgrade (shepherd upgrade)", upgrade, "upgrade"),
        ("one leader election (leader powered off)", elected, "election"),
    ):
        print(
            f"{name:<46} {seconds or 0:8.1f} {writes.longest_refusal(phase):15.2f}s "
            f"{writes.gaps.get(phase, 0):11.2f}s"
        )
    print(f"writes accepted {writes.accepted}, failed {writes.refused}, lost {len(writes.lost)}")
    for line in writes.lost[:5]:
        print(f"  lost: {line}")
    if floor is None or upgrade is None:
        print(f"upgrade/restarts (time ratio): not measured, a phase did not finish\n{how}")
        return 1
    ratio = upgrade / floor
    print(f"upgrade/restarts (time ratio): {ratio:.2f} (goal <= 1.5)")
    report("upgrade", f"{args.machines} real machines: upgrade / plain reboots", ratio, "<= 1.5")
    if elected:
        report(
            "upgrade",
            "longest refused write during the upgrade / during one leader election",
            writes.longest_refusal("upgrade") / elected,
            "<= 1",
        )
    return 0 if not writes.lost else 1


def run(args: argparse.Namespace) -> int:
    """``bench.upgrade --real-machines``: needs root and systemd-nspawn."""
    if os.geteuid() != 0 or shutil.which("systemd-nspawn") is None:
        print("bench.upgrade --real-machines: needs root and systemd-nspawn", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bur-", dir="/tmp"))
    try:
        return trio.run(main_async, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
