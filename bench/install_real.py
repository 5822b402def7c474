"""``python -m bench.install --real-machines``: the install on real machines, three measures.

The machines are nspawn machines (`shepherd.nspawn`: systemd as PID 1, a
NIC of their own, a 256 MiB loop-device disk, a Redfish BMC). Each path has
a fleet of its own, booted fresh (not timed: setup), and a cluster whose
first node runs on the host's bridge address (`shepherd.localcluster`).

1. Install, ``--machines`` machines (default 5), from the request to every
   node approved and healthy:

   - product (`shepherd.realfleet`): the machines taken over by the
     initializer (setup); timed: `shepherd.install.install` writes each
     machine's request, the agents (the Shepherd's heartbeat interval) see
     it, download the image, partition the disk, write system A and read it
     back, the boot record, the data partition, the boot entry, start the
     node's unit; the approver (its default interval) approves the nodes.
   - by hand, ``--by-hand-parallelism`` machines at once (default 5), over
     OpenSSH with ControlMaster: ``ssh -M``; ``scp`` of the image and the
     parameters; one ``ssh`` running sfdisk (the same layout), partx, mknod
     (no udev), ``dd`` of the image onto system A, mkfs.ext4 and a mount of
     the data partition, the unit written, ``systemctl start`` (``node
     register``); the announced key read back; ``metropolis owner approve``
     (retried until the node has registered); ``ssh -O exit``.

   Ratio: by hand / product (goal >= 2).

2. Reboot, on the product's machine 0: ``systemctl reboot`` until its sshd
   answers (S); the node's unit restarted until the node's next heartbeat
   (N, the node's own start); ``systemctl reboot`` until the node's next
   heartbeat with the node healthy (R). Goal: R <= 1.5 S + N.

3. Wipe of a 1 GiB disk (a loop device on this host, installed first with
   the same layout): `shepherd.agent.diskwipe.wipe_device` (wipefs of each
   partition and of the table, blkdiscard, read back) against ``blkdiscard``
   alone on the same disk installed again. Ratio: wipe / blkdiscard.

Needs root, systemd-nspawn, mmdebstrap (first build of the machines' root),
PostgreSQL 15, etcd. Prints each path's phases and the ratios
(`bench.ratios`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

from bench.ratios import report
from bmdb.localserver import LocalPostgres
from metropolis import identity
from metropolis.image.build import default_etcd
from metropolis.owner import NodeRow
from metropolis.proto import parameters
from shepherd.agent import bootentry, diskwipe, realdisk
from shepherd.demo_cluster import default_image_cache, node_image
from shepherd.install import owner_public_key
from shepherd.localcluster import FirstNode, open_first_node
from shepherd.nspawn.fleet import Fleet, open_fleet
from shepherd.realfleet import SMALL_LAYOUT, RealFleet, open_real_fleet
from shepherd.ssh_key import SSHKey

MIB = 1 << 20
POLL = 0.25
#: Machines per path, and the by-hand path's machines at once.
DEFAULT_MACHINES = 5
_T0 = time.monotonic()


def say(line: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}] {line}", flush=True)


@dataclass
class Timing:
    """When each machine passed each phase (seconds since the request)."""

    machines: int
    phases: dict[str, list[float]] = field(default_factory=dict)
    total: float | None = None
    failures: list[str] = field(default_factory=list)
    #: Where one machine's time went, in one line.
    detail: str = ""
    #: Its boot helper's and node's journal, seconds since the request.
    timeline: list[str] = field(default_factory=list)

    def mark(self, phase: str, at: float) -> None:
        self.phases.setdefault(phase, []).append(at)

    def lines(self, name: str) -> list[str]:
        out = [name]
        for phase, times in self.phases.items():
            out.append(
                f"  {phase:<22} {len(times):>2}/{self.machines}   last at {max(times):6.1f} s"
            )
        out += [f"  failed: {f}" for f in self.failures[:5]]
        if self.detail:
            out.append(f"  machine 0: {self.detail}")
        if self.timeline:
            out.append("  machine 0's boot helper and node (journal, s since the request):")
            out += [f"    {line}" for line in self.timeline]
        return out


#: Most journal lines of the timeline.
_TIMELINE_LINES = 24


def _timeline(journal: str, since: float) -> list[str]:
    """``journalctl -o short-unix`` lines as "+T unit: message", T in seconds since ``since``."""
    out = []
    for line in journal.splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            at = float(stamp)
        except ValueError:
            continue
        _host, _, message = rest.partition(" ")
        out.append(f"+{at - since:6.2f} {message[:110]}")
        if len(out) >= _TIMELINE_LINES:
            break
    return out


def healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


async def nodes(first: FirstNode) -> dict[str, NodeRow]:
    try:
        async with first.access.open() as owner:
            return {r.address: r for r in await owner.nodes() if r.address}
    except Exception:  # the curators busy: look again
        return {}


async def until_healthy(
    first: FirstNode, addresses: list[str], timing: Timing, start: float, within: float
) -> None:
    seen: set[str] = set()
    with trio.move_on_after(within):
        while len(seen) < len(addresses):
            rows = await nodes(first)
            for address in addresses:
                if address not in seen and healthy(rows.get(address)):
                    seen.add(address)
                    timing.mark("healthy", trio.current_time() - start)
            await trio.sleep(POLL)
        timing.total = trio.current_time() - start
        return
    timing.failures.append(f"{len(addresses) - len(seen)} node(s) not healthy in {within:g} s")


# --- the product's path ----------------------------------------------------------------


async def product(args: argparse.Namespace, work: Path, image: Path, url: str) -> Timing:
    timing = Timing(args.machines)
    async with open_real_fleet(
        work,
        bmdb_url=url,
        count=args.machines,
        image=image,
        heartbeat_interval=args.heartbeat_interval,
        approve_interval=args.approve_interval,
        decommission=False,
    ) as real:
        say(f"product: {args.machines} machines taken over; installing")
        start = trio.current_time()
        requested_at = time.time()
        await real.request(range(args.machines))
        timing.mark("requested", trio.current_time() - start)
        async with trio.open_nursery() as nursery:

            async def installed() -> None:
                left = set(range(args.machines))
                while left:
                    for index in sorted(left):
                        got = await real.installation(index)
                        if got is not None and got.reported:
                            left.discard(index)
                            timing.mark(f"reported {got.state}", trio.current_time() - start)
                    await trio.sleep(POLL)

            nursery.start_soon(installed)
            addresses = [real.machines.address(i) for i in range(args.machines)]
            await until_healthy(real.first, addresses, timing, start, args.timeout)
            nursery.cancel_scope.cancel()
        say(f"product: {timing.total}")
        log = await _ssh(real.ssh_key_file, real.machines.address(0), "cat /root/agent.log")
        steps = [line for line in log.splitlines() if "download+verify" in line]
        timing.detail = steps[-1].split("agent: ", 1)[-1] if steps else "(no agent log line)"
        journal = await _ssh(
            real.ssh_key_file,
            real.machines.address(0),
            f"journalctl -o short-unix --no-pager -u {bootentry.PREPARE_UNIT}"
            f" -u {bootentry.NODE_UNIT}",
            check=False,
        )
        timing.timeline = _timeline(journal, requested_at)
        if timing.total is not None:
            await reboots(args, real)
    return timing


async def _ssh(key: Path, address: str, command: str, *, check: bool = True) -> str:
    done = await trio.run_process(
        [
            "ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=5", f"root@{address}", command,
        ],
        capture_stdout=True, capture_stderr=True, check=False,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise RuntimeError(f"{command!r} on {address}: {done.stderr.decode()[-300:]}")
    return done.stdout.decode()


async def _sshd_answers(address: str) -> None:
    while True:
        try:
            stream = await trio.open_tcp_stream(address, 22)
        except OSError:
            await trio.sleep(0.05)
            continue
        async with stream:
            with trio.move_on_after(2):
                if (await stream.receive_some(4)).startswith(b"SSH"):
                    return
        await trio.sleep(0.05)


async def _beat_after(first: FirstNode, address: str, since: float) -> None:
    """Until the node on ``address`` is healthy with a heartbeat after ``since``."""
    while True:
        row = (await nodes(first)).get(address)
        beat = row.since_heartbeat if row is not None else None
        if healthy(row) and beat is not None and beat < trio.current_time() - since:
            return
        await trio.sleep(POLL)


async def reboots(args: argparse.Namespace, real: RealFleet) -> None:
    """Measure 2 of the module on machine 0."""
    key, address = real.ssh_key_file, real.machines.address(0)
    machine = real.machines.machines[0]

    async def reboot() -> float:
        boots = machine.boots
        await _ssh(key, address, "systemctl reboot", check=False)
        started = trio.current_time()
        while machine.boots == boots:  # noqa: ASYNC110 (the fleet's task counts boots)
            await trio.sleep(0.02)
        return started

    with trio.fail_after(args.timeout):
        started = await reboot()
        await _sshd_answers(address)
        sshd = trio.current_time() - started
        await _beat_after(real.first, address, trio.current_time())  # settled again
        started = trio.current_time()
        await _ssh(key, address, f"systemctl restart {bootentry.NODE_UNIT}")
        await _beat_after(real.first, address, started)
        node = trio.current_time() - started
        started = await reboot()
        await _beat_after(real.first, address, started)
        healthy_after = trio.current_time() - started
    print("\nreboot of one machine (its node pushes its status every 5 s)")
    print(f"  reboot -> sshd answers (S):               {sshd:6.2f} s")
    print(f"  node unit restart -> its next heartbeat (N): {node:6.2f} s")
    print(f"  reboot -> node healthy, heartbeat after (R): {healthy_after:6.2f} s")
    goal = 1.5 * sshd + node
    print(f"  R / (1.5 S + N): {healthy_after / goal:.2f} (goal <= 1)")
    report(
        "install", "reboot: node healthy / (1.5 x sshd + node start)", healthy_after / goal, "<= 1"
    )


# --- by hand ---------------------------------------------------------------------------

#: One ssh command per machine: what the agent's install does, the way an
#: operator types it (no read-back, no boot record: the quick way).
_BY_HAND = """set -e
disk=/dev/{disk}
printf 'label: gpt\\nsize={boot}MiB\\nsize={system}MiB\\nsize={system}MiB\\nsize=+\\n' | sfdisk -q --wipe always $disk
partx -u $disk
for p in 1 2 3 4; do
  test -e ${{disk}}p$p || mknod ${{disk}}p$p b $(tr : ' ' < /sys/class/block/{disk}p$p/dev)
done
dd if=/root/image.pyz of=${{disk}}p2 bs=1M conv=fsync status=none
mkfs.ext4 -q -F ${{disk}}p4
mkdir -p /var/lib/metropolis /run/metropolis
mount ${{disk}}p4 /var/lib/metropolis
cat > /etc/systemd/system/metropolis-node.service <<EOF
[Service]
Environment=SHIV_ROOT=/var/cache/metropolis/shiv
ExecStart=/usr/bin/python3 /root/image.pyz node register --parameters /root/node-parameters.pb --root /var/lib/metropolis/metropolis --address {address} --insecure-seal --announce-key /run/metropolis/node.key.pub
Restart=always
EOF
systemctl daemon-reload
systemctl start metropolis-node.service
"""  # noqa: E501


async def by_hand_one(
    index: int, fleet: Fleet, key: Path, first: FirstNode, image: Path, params: Path,
    timing: Timing, start: float,
) -> None:  # fmt: skip
    address = fleet.address(index)
    control = key.parent / f"ctl-{index}"
    common = [
        "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
        "-o", f"ControlPath={control}",
    ]  # fmt: skip
    login = f"root@{address}"

    async def run(argv: list[str]) -> bytes:
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]}: {done.stderr.decode(errors='replace')[-300:]}")
        return bytes(done.stdout)

    await run(
        ["ssh", *common, "-o", "ControlMaster=yes", "-o", "ControlPersist=yes", "-f", "-N", login]
    )
    try:
        await run(["scp", *common, "-q", str(image), f"{login}:/root/image.pyz"])
        await run(["scp", *common, "-q", str(params), f"{login}:/root/node-parameters.pb"])
        timing.mark("copied", trio.current_time() - start)
        script = _BY_HAND.format(
            disk=fleet.disks[index].name, address=address, boot=SMALL_LAYOUT.boot_mib,
            system=SMALL_LAYOUT.system_mib,
        )  # fmt: skip
        await run(["ssh", *common, login, script])
        timing.mark("written, started", trio.current_time() - start)
        while True:
            announced = await run(
                ["ssh", *common, login, "cat /run/metropolis/node.key.pub 2>/dev/null; true"]
            )
            if len(announced) == 32:
                break
            await trio.sleep(POLL)
        node = identity.node_id(announced)
        owner = [
            sys.executable, "-m", "metropolis", "owner", "--root", str(first.root.path),
            "--owner-key", str(first.owner_key), "approve", node,
        ]  # fmt: skip
        while True:
            try:
                await run(owner)
                break
            except RuntimeError:  # not registered yet: again
                await trio.sleep(0.5)
        timing.mark("approved", trio.current_time() - start)
    finally:
        with trio.CancelScope(shield=True):
            await trio.run_process(
                ["ssh", *common, "-O", "exit", login], capture_stdout=True, capture_stderr=True,
                check=False,
            )  # fmt: skip


async def by_hand(args: argparse.Namespace, work: Path, image: Path) -> Timing:
    timing = Timing(args.machines)
    key = SSHKey.generate()
    key_file = work / "id_ed25519"

    def write_key() -> None:
        work.mkdir(parents=True)
        key_file.write_bytes(key.openssh_private)
        key_file.chmod(0o600)

    await trio.to_thread.run_sync(write_key)
    async with (
        open_fleet(work / "machines", count=args.machines, authorized_keys=[key.authorized_key],
                   disk_size=256 * MIB) as fleet,
        open_first_node(work / "first", fleet.host_address, work / "owner.pem", work / "first.log")
        as first,
    ):  # fmt: skip
        async with first.access.open() as owner:
            ticket = await owner.ticket()
        owner_key = owner_public_key(first.owner_key.read_bytes(), str(first.owner_key))
        params = work / "node-parameters.pb"
        params.write_bytes(
            parameters.encode(parameters.register_parameters(first.info, ticket, owner_key))
        )
        say(f"by hand: {args.machines} machines up, {args.by_hand_parallelism} at once")
        start = trio.current_time()
        limiter = trio.CapacityLimiter(args.by_hand_parallelism)

        async def one(index: int) -> None:
            async with limiter:
                try:
                    await by_hand_one(index, fleet, key_file, first, image, params, timing, start)
                except RuntimeError as e:
                    timing.failures.append(f"machine {index}: {e}")

        async with trio.open_nursery() as nursery:
            for index in range(args.machines):
                nursery.start_soon(one, index)
            addresses = [fleet.address(i) for i in range(args.machines)]
            await until_healthy(first, addresses, timing, start, args.timeout)
            nursery.cancel_scope.cancel()
        say(f"by hand: {timing.total}")
    return timing


# --- the wipe --------------------------------------------------------------------------


@contextlib.contextmanager
def _loop(path: Path, size: int) -> Iterator[str]:
    with path.open("wb") as f:
        f.truncate(size)
    device = subprocess.run(
        ["losetup", "-f", "--show", "-P", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def wipe(work: Path, image: Path) -> tuple[float, float]:
    """Measure 3: (wipe_device seconds, blkdiscard seconds) on a 1 GiB loop disk."""
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    target = bootentry.Target(systemd_root=str(work / "units"), helper_dir=str(work / "lib"))
    os.makedirs(target.systemd_root, exist_ok=True)
    times = []
    with _loop(work / "wipe.img", 1 << 30) as device:
        for how in ("wipe", "blkdiscard"):
            realdisk.install_device(
                device, str(image), digest, b"parameters", "198.18.0.9",
                layout=SMALL_LAYOUT, target=target,
            )  # fmt: skip
            subprocess.run(["dd", "if=/dev/urandom", f"of={device}p4", "bs=1M", "count=512",
                            "status=none", "oflag=direct"], check=True)  # fmt: skip
            started = time.perf_counter()
            if how == "wipe":
                diskwipe.wipe_device(device)
            else:
                subprocess.run(["blkdiscard", "-f", device], check=True)
            times.append(time.perf_counter() - started)
    return times[0], times[1]


# --- the run ---------------------------------------------------------------------------


async def main_async(args: argparse.Namespace, work: Path) -> int:
    # The cached build of today's inputs (the demo's cache): not measured here.
    image = await node_image(default_image_cache(), default_etcd())
    size = image.stat().st_size
    say(f"image: {image.name} ({size / 1e6:.1f} MB)")
    hand = await by_hand(args, work / "h", image)
    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    postgres.create()
    postgres.start()
    try:
        postgres.create_database("bench")
        async with trio_asyncio.open_loop():
            prod = await product(args, work / "p", image, postgres.url("bench"))
    finally:
        postgres.stop()
        shutil.rmtree(postgres.root, ignore_errors=True)
    wiped, discarded = await trio.to_thread.run_sync(wipe, work, image)

    print(f"\n{args.machines} real machines (nspawn), {os.cpu_count()} CPUs, "
          f"image {size / 1e6:.1f} MB; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"product: agents heartbeat every {args.heartbeat_interval:g} s, approver every "
          f"{args.approve_interval:g} s; by hand: {args.by_hand_parallelism} at once")  # fmt: skip
    for line in prod.lines("product: shepherd install + agents + approver") + hand.lines(
        "by hand: OpenSSH ControlMaster, sfdisk, dd, mkfs, the unit, owner approve"
    ):
        print(line)
    print(f"\nwipe of a 1 GiB disk: wipe_device {wiped:.2f} s, blkdiscard alone {discarded:.2f} s,"
          f" ratio {wiped / discarded:.1f}")  # fmt: skip
    report("install", "wipe of 1 GiB: wipe_device / blkdiscard", wiped / discarded)
    if prod.total is None or hand.total is None:
        print("install on real machines: by hand / product (time ratio): not measured")
        return 1
    ratio = hand.total / prod.total
    print(
        f"install on real machines, request -> all healthy: product {prod.total:.1f} s, "
        f"by hand {hand.total:.1f} s"
    )
    print(f"install on real machines: by hand / product (time ratio): {ratio:.2f} (goal >= 2)")
    report("install", f"{args.machines} real machines: by-hand time / product time", ratio, ">= 2")
    return 0


def run(args: argparse.Namespace) -> int:
    """``bench.install --real-machines``: needs root and systemd-nspawn."""
    if os.geteuid() != 0 or shutil.which("systemd-nspawn") is None:
        print("bench.install --real-machines: needs root and systemd-nspawn", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="br-", dir="/tmp"))
    try:
        return trio.run(main_async, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
