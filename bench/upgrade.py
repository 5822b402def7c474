"""A rolling upgrade of a cluster against the same nodes' plain restarts, one at a time.

    python -m bench.upgrade --real-machines [--machines 5] [--consensus 3] [--timeout 900]
    python -m bench.upgrade [--machines 5] [--consensus 2] [--timeout 900]
                            [--loopback-block B] [--smoke]

``--real-machines``: on nspawn machines, against their plain reboots, and a
leader election measured in the same run (`bench.upgrade_real`: the
issue's benchmark). Without it, ON THE LOOPBACK FLEET, a quicker proxy
(and the smoke run): a cluster is bootstrapped on 127.B.1.1; ``--machines``
loopback machines are taken over, installed and approved by the product
(not timed: setup), the first ``--consensus`` of them granted
ConsensusMember (etcd then has that many voters plus the first node).
Then, timed:

- floor: each machine's node restarted once, one after the other, from the
  image it runs (the loopback stand-in for a plain reboot: SIGTERM, then
  ``node run`` started as the agent starts it), each time until the node
  announces itself healthy (the cluster took its status and its roles run:
  the same bar an upgrade's try must pass) and the owner's table shows it
  UP and HEALTHY (and a voter, if it was). The sum of these.
- upgrade: ``shepherd.upgrade`` writes a run of every machine to a second
  image (the same node in other bytes), the Shepherd's upgrader (its
  control loop, in this process) moves them, until the run is finished.

Meanwhile a writer (`writer`) changes the first node's roles through the
curator (``UpdateNodeRoles``, a leader-guarded etcd transaction) every 100
ms and reads each write back; the longest time between two accepted writes
and the longest refusal are printed for both phases, against the curator's
lease TTL (10 s by default), the bound of one leader election (a curator
leader that dies blocks writes at most that long). The leader here is the
first node, which no phase restarts.

Prints both times and the ratio upgrade / floor (goal <= 1.5).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bench.install import (
    HEARTBEAT_INTERVAL,
    POLL,
    bootstrap,
    healthy,
    install_plan,
    nodes_by_address,
    reap,
    run_in_scratch,
    say,
    take_over,
)
from bench.ratios import report
from bench.smoke import parse_args
from bmdb.localserver import LocalPostgres
from bmdb.model import Queries, UpgradeState
from metropolis.errors import MetropolisError
from metropolis.image.build import default_etcd
from metropolis.image.cache import ensure_image
from metropolis.owner import OwnerAccess
from metropolis.proto import management as m
from metropolis.rpc import methods
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.install import image_from_server, install
from shepherd.localfleet import (
    DISK,
    LOOPBACK_BLOCKS,
    first_node_address,
    loopback_addresses,
    node_pid,
    open_fleet,
    stop_node,
)
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh_key import SSHKey
from shepherd.upgrade import ask_writes, choose
from shepherd.upgrader import Upgrader

#: The curator's default lease TTL: the bound of one leader election.
LEASE_TTL = 10.0


@dataclass
class Writes:
    """Writes through the curator: accepted, failed, lost; per phase the
    longest gap between two accepted writes and the longest refusal (from a
    failed write to the next accepted one)."""

    accepted: int = 0
    refused: int = 0
    last: float | None = None
    gaps: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, float] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    phase: str = "setup"
    #: The value of the last accepted write (None after a failed one: unknown).
    expected: bool | None = None
    _refused_since: float | None = None

    def ok(self, now: float, value: bool) -> None:
        if self.last is not None:
            gap = now - self.last
            self.gaps[self.phase] = max(self.gaps.get(self.phase, 0.0), gap)
        if self._refused_since is not None:
            refusal = now - self._refused_since
            self.refusals[self.phase] = max(self.refusals.get(self.phase, 0.0), refusal)
            self._refused_since = None
        self.last = now
        self.accepted += 1
        self.expected = value

    def failed(self, now: float) -> None:
        self.refused += 1
        self.expected = None
        if self._refused_since is None:
            self._refused_since = now

    def read_back(self, seen: bool) -> None:
        if self.expected is not None and seen != self.expected:
            self.lost.append(f"write #{self.accepted} ({self.expected}) read back as {seen}")

    def last_ok_after(self, at: float) -> bool:
        return self.last is not None and self.last > at

    def longest_refusal(self, phase: str) -> float:
        return self.refusals.get(phase, 0.0)


async def writer(access: OwnerAccess, key: bytes, writes: Writes) -> None:
    """Toggle the KubernetesController role of the node of ``key`` every 100 ms
    through the curators, reading each write back, forever."""
    on = False
    while True:
        try:
            async with access.open() as owner:
                while True:
                    on = not on
                    with trio.fail_after(LEASE_TTL):
                        await owner.client.unary(
                            methods.UPDATE_NODE_ROLES,
                            m.UpdateNodeRolesRequest(pubkey=key, kubernetes_controller=on),
                        )
                    writes.ok(trio.current_time(), on)
                    try:
                        with trio.fail_after(LEASE_TTL):
                            rows = await owner.nodes()
                    except (MetropolisError, OSError, trio.TooSlowError):
                        pass  # a read that fails refuses no write
                    else:
                        row = next((r for r in rows if r.public_key == key), None)
                        if row is not None:
                            writes.read_back("KubernetesController" in row.roles)
                    await trio.sleep(0.1)
        except (MetropolisError, OSError, trio.TooSlowError) as e:
            writes.failed(trio.current_time())
            say(f"writer: refused ({e}); again")
            await trio.sleep(0.1)


def variant(image: Path, out: Path) -> Path:
    """The same node in other bytes (a comment line after the shebang)."""
    data = image.read_bytes()
    first = data.index(b"\n") + 1
    other = data[:first] + b"# bench.upgrade: the second image\n" + data[first:]
    path = out / f"{hashlib.sha256(other).hexdigest()}.pyz"
    path.write_bytes(other)
    return path


async def restart(disk: Path, python: str) -> None:
    """The node of ``disk`` stopped and started again from its image, as the agent does."""
    pid = node_pid(disk)
    stop_node(disk)
    while pid is not None and node_pid(disk) == pid:  # noqa: ASYNC110 (another process)
        await trio.sleep(0.05)
    announce = disk / "healthy-restart.json"
    announce.unlink(missing_ok=True)
    argv = [
        *(python, str(disk / "image.pyz"), "node", "run"),
        *("--root", str(disk / "metropolis"), "--announce-healthy", str(announce)),
    ]
    with (disk / "node.log").open("ab") as log:
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=disk,
            start_new_session=True,
        )  # fmt: skip
    (disk / "node.pid").write_text(f"{process.pid}\n")
    while not announce.exists():
        if process.poll() is not None:
            raise RuntimeError(f"the restarted node of {disk} exited")
        await trio.sleep(POLL)


async def main_async(args: argparse.Namespace, work: Path) -> int:
    images = work / "images"
    images.mkdir()
    built = await trio.to_thread.run_sync(
        ensure_image, Path(tempfile.gettempdir(), "metropolis-image-bench"), default_etcd()
    )
    first_image = images / built.name
    shutil.copyfile(built, first_image)
    second = variant(first_image, images)
    hosts = loopback_addresses(args.machines, block=args.loopback_block)
    first = first_node_address(args.loopback_block)
    key = SSHKey.generate()
    os.environ["SHIV_ROOT"] = str(work / "shiv")
    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    postgres.create()
    postgres.start()
    postgres.admin("CREATE DATABASE bench_upgrade")
    writes = Writes()
    floor = upgrade_total = None
    try:
        async with (
            trio_asyncio.open_loop(),
            open_fleet(
                work / "fleet", count=args.machines, authorized_key=key.authorized_key, hosts=hosts
            ) as fleet,
            bmdb.open_connection(postgres.url("bench_upgrade"), migrate=True) as conn,
            bootstrap(work / "cluster", first) as cluster,
            trio.open_nursery() as nursery,
        ):
            served: str = await nursery.start(
                serve_images, ImageServerConfig("127.0.0.1:0", images)
            )
            with trio.fail_after(args.timeout):
                ids = await take_over(
                    nursery, conn, fleet, key, work / "machines.toml",
                    heartbeat_interval=args.heartbeat_interval,
                )  # fmt: skip
            await install(conn, install_plan(cluster, served, first_image), machines=ids)
            nursery.start_soon(run_approver, cluster.access, conn, 0.5)
            say(f"installing {args.machines} machines")
            with trio.fail_after(args.timeout):
                while True:
                    now = await nodes_by_address(cluster)
                    if all(healthy(now.get(h)) for h in hosts):
                        break
                    await trio.sleep(POLL)
                async with cluster.access.open() as owner:
                    for host in hosts[: args.consensus]:
                        row = (await nodes_by_address(cluster))[host]
                        await owner.set_roles(row.node_id, consensus_member=True)
                while True:
                    rows_now = await nodes_by_address(cluster)
                    if all(
                        rows_now[h].etcd == "voter" and healthy(rows_now[h])
                        for h in hosts[: args.consensus]
                    ):
                        break
                    await trio.sleep(POLL)
            say("installed; consensus members voting; measuring")
            first_key = (await nodes_by_address(cluster))[first].public_key
            nursery.start_soon(writer, cluster.access, first_key, writes)
            while writes.accepted < 3:  # noqa: ASYNC110 (the writer's progress)
                await trio.sleep(POLL)

            # The floor: plain restarts, one at a time.
            writes.phase = "restarts"
            began = trio.current_time()
            for machine, host in zip(fleet.machines, hosts, strict=True):
                was_voter = hosts.index(host) < args.consensus
                with trio.fail_after(args.timeout):
                    await restart(machine.root / DISK, sys.executable)
                    while True:
                        found = (await nodes_by_address(cluster)).get(host)
                        if healthy(found) and (
                            not was_voter or (found is not None and found.etcd == "voter")
                        ):
                            break
                        await trio.sleep(POLL)
            floor = trio.current_time() - began
            say(f"restarts, one at a time: {floor:.1f} s")

            # The upgrade, by the product.
            writes.phase = "upgrade"
            start_control_loop(
                nursery,
                conn,
                Upgrader(cluster.access, poll=POLL),
                parallelism=2,
                limiter=RateLimiter(Rate(interval=0.01, burst=2)),
            )
            digest = "sha256:" + second.name.removesuffix(".pyz")
            image = image_from_server(served, digest, plain_http=True)
            async with cluster.access.open() as owner:
                view = await owner.nodes()
            began = trio.current_time()

            async def create(q: Queries) -> uuid.UUID:
                chosen = await choose(q, ids, digest, view)
                entries = [c.entry for c in chosen if c.entry is not None]
                run = await q.create_upgrade_run(
                    image_digest=digest,
                    os_image=bytes(image.message()),
                    max_unavailable=1,
                    health_timeout=120,
                    requested_by="bench",
                    machines=entries,
                )
                await ask_writes(q, run, entries)  # as `shepherd upgrade` does
                return run.run_id

            run_id = await conn.transact(create, isolation=bmdb.Isolation.SERIALIZABLE)
            with trio.fail_after(args.timeout):
                while True:
                    run = await conn.transact(lambda q: q.upgrade_run(run_id))
                    assert run is not None
                    if run.finished_at is not None:
                        break
                    await trio.sleep(POLL)
            upgrade_total = trio.current_time() - began
            members = await conn.transact(lambda q: q.upgrade_machines(run_id))
            if run.stop_cause or any(m_.state is not UpgradeState.UPGRADED for m_, _ in members):
                say(f"the upgrade stopped: {run.stop_cause}")
                upgrade_total = None
            else:
                say(f"upgrade of {args.machines} machines: {upgrade_total:.1f} s")
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for disk in (work / "fleet").glob(f"*/{DISK}"):
                stop_node(disk)
            await reap(work)
        os.environ.pop("SHIV_ROOT", None)
        postgres.stop()
        shutil.rmtree(postgres.root, ignore_errors=True)
    print(
        f"\n{args.machines} loopback machines ({args.consensus} consensus members + the first "
        f"node as etcd voters), agents' heartbeat every {args.heartbeat_interval:g} s, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'phase':<44} {'seconds':>10} {'longest write gap':>18}")
    gap = writes.gaps
    for name, seconds, phase in (
        ("restarts, one at a time (the floor)", floor, "restarts"),
        ("rolling upgrade (shepherd upgrade)", upgrade_total, "upgrade"),
    ):
        print(f"{name:<44} {seconds or 0:10.1f} {gap.get(phase, 0):17.2f}s")
    print(
        f"writes accepted {writes.accepted}, refused {writes.refused}; "
        f"one leader election: <= {LEASE_TTL:g} s"
    )
    if floor is None or upgrade_total is None:
        print("upgrade/restarts (time ratio): not measured, a phase did not finish")
        return 1
    ratio = upgrade_total / floor
    print(f"upgrade/restarts (time ratio): {ratio:.2f} (goal <= 1.5)")
    report(
        "upgrade", f"{args.machines} loopback machines: upgrade / plain restarts", ratio, "<= 1.5"
    )
    report(
        "upgrade",
        "longest write gap during the upgrade / one leader election (lease TTL)",
        gap.get("upgrade", 0.0) / LEASE_TTL,
        "<= 1",
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=5)
    parser.add_argument(
        "--consensus",
        type=int,
        default=2,
        help="machines made members (default 2; 3 with --real-machines, whose first node "
        "then gives its role up)",
    )
    parser.add_argument(
        "--real-machines",
        action="store_true",
        help="on nspawn machines, against plain reboots (bench.upgrade_real); needs root",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per phase, seconds")
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=HEARTBEAT_INTERVAL,
        help="the agents' (default: the Shepherd's, %(default)s s): an upgrade request "
        "reaches an agent with its next heartbeat's answer",
    )
    parser.add_argument(
        "--loopback-block",
        type=int,
        default=0,
        metavar="B",
        help="machines on 127.B.0.2 on, the first node on 127.B.1.1 (default: %(default)s)",
    )
    args = parse_args(
        parser, {"machines": 1, "consensus": 0, "timeout": 240.0, "heartbeat_interval": 1.0}
    )
    if args.real_machines:
        from bench import upgrade_real

        if args.consensus == parser.get_default("consensus"):
            args.consensus = upgrade_real.DEFAULT_CONSENSUS
        if args.heartbeat_interval == parser.get_default("heartbeat_interval"):
            args.heartbeat_interval = upgrade_real.HEARTBEAT_INTERVAL
        if not 1 <= args.consensus <= args.machines:
            parser.error("want 1 <= --consensus <= --machines")
        return upgrade_real.run(args)
    if args.machines < 1 or not 0 <= args.consensus <= args.machines:
        parser.error("want --machines >= 1 and 0 <= --consensus <= --machines")
    if not 0 <= args.loopback_block < LOOPBACK_BLOCKS:
        parser.error(f"--loopback-block must be in 0-{LOOPBACK_BLOCKS - 1}")
    return run_in_scratch(main_async, args, "bu-")


if __name__ == "__main__":
    raise SystemExit(main())
