"""From the install request to every node approved and healthy: the product against OpenSSH by hand.

    python -m bench.install [--machines 20] [--by-hand-parallelism N] [--timeout 900]
                            [--loopback-block B] [--smoke]
    python -m bench.install --real-machines    (nspawn machines: bench.install_real)

Both paths install the same node image (built first, timed) with the same
NodeParameters onto ``--machines`` machines, each node on its own loopback
address 127.B.0.N on the nodes' fixed ports, into a fresh cluster whose
first node bootstraps on 127.B.1.1 (B: ``--loopback-block``, 0 by default).
They run one after the other, each with its own cluster (the first path's
processes are gone before the second starts: the addresses and ports are the
same), in the same run.
Run it under the shared lock (``flock /work/wt/net.lock``): the addresses
and ports are fixed (two runs at once need different ``--loopback-block``).

- product: a loopback fleet (`shepherd.localfleet`, asyncssh servers) is
  taken over by the initializer (not timed: that is setup), the agents
  heartbeat to the agent callback server with the Shepherd's default
  heartbeat interval (10 s), the image server serves the image. Timed:
  `shepherd.install.install` writes every request in one transaction (as
  ``python -m shepherd install`` does); each agent downloads, verifies,
  writes and starts its node, which registers; the Shepherd's approver
  (`shepherd.approver`, its default interval of 5 s) approves them; until
  every node is UP and HEALTHY in the curators' view.
- by hand: one real OpenSSH sshd (`shepherd.localsshd`) stands for every
  machine, each machine a folder of its own. Per machine, with
  ``--by-hand-parallelism`` machines at once: ``ssh -M`` (ControlMaster)
  and over it ``sftp`` (the image and the parameters), ``sha256sum`` (the
  digest checked, as the
  agent does), ``node register`` started detached, its announced key read
  back, ``python -m metropolis owner approve`` (retried until the node has
  registered; a node that exited before registering, as ``node register``
  does when the curator does not answer in time, is started again on a
  cleared root, as an operator would); then ``ssh -O exit``; until every
  node is UP and HEALTHY.

Both nodes' shiv caches (``SHIV_ROOT``) are one fresh folder per path, so
each path pays one extraction of the image's site-packages (a real
machine pays its own).

Prints the image build time, the image's download time from the image
server (one client alone) and per machine within each path, each path's
phases, and the time ratio by hand / product (goal: >= 2). If a path does
not finish within ``--timeout``, it prints how many nodes got how far.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx
import trio
import trio_asyncio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb.localserver import LocalPostgres
from bmdb.model import InstallState, Queries
from common.backoff import FULL_JITTER, ExponentialBackoff, Retrier
from metropolis import identity
from metropolis.image.build import BuiltImage, build_image, default_etcd
from metropolis.localstorage import Root
from metropolis.owner import NodeRow, OwnerAccess, load_owner, load_owner_key
from metropolis.proto import parameters
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.agent_server.server import port_of
from shepherd.approver import DEFAULT_INTERVAL as APPROVE_INTERVAL
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.demo import write_machines_file
from shepherd.initializer import Initializer
from shepherd.install import Plan, image_from_server, install, owner_public_key
from shepherd.localfleet import (
    DISK,
    LOOPBACK_BLOCKS,
    Fleet,
    agent_config,
    first_node_address,
    loopback_addresses,
    node_pid,
    open_fleet,
    stop_node,
)
from shepherd.localsshd import start_sshd, stop_sshd
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey

#: The Shepherd's defaults (``python -m shepherd --help``).
HEARTBEAT_INTERVAL = 10.0
HEARTBEAT_BACKOFF_CAP = 60.0
#: When the run began (for the progress lines).
_T0 = time.monotonic()
#: The takeover is setup, not measured: done a few machines at once.
TAKEOVER_PARALLELISM = 4
#: What a bootstrap node logs once its curator leads.
LEADS = "this curator leads"
#: What the agent logs of an install's steps.
_AGENT_DOWNLOAD = re.compile(r"download\+verify of (\d+) bytes ([0-9.]+)s")
#: How often the by-hand path starts a machine's node before it gives up.
MAX_REGISTERS = 5
#: How often the paths look at the cluster and the BMDB.
POLL = 0.25

PRODUCT = "product: shepherd install + agents + approver"
BY_HAND = "by hand: OpenSSH ControlMaster + owner approve"


@dataclass
class Progress:
    """How far a path got, and when (seconds since its start)."""

    machines: int
    #: Phase name -> seconds when every machine had passed it.
    phases: dict[str, float] = field(default_factory=dict)
    #: Phase name -> machines that passed it (at the end).
    counts: dict[str, int] = field(default_factory=dict)
    #: Seconds each machine's image download took (the agent's own
    #: download+verify, or the by-hand sftp of image and parameters).
    downloads: list[float] = field(default_factory=list)
    #: Seconds one client alone took to download the image (product path).
    download_alone: float | None = None
    #: Seconds until every node was UP and HEALTHY; None if not all got there.
    total: float | None = None
    #: The last error of a look at the cluster ("" when the last look worked).
    error: str = ""
    #: Nodes started again by hand: they exited before they were registered.
    restarts: int = 0
    #: Why machines cannot finish (the path then stops early).
    failures: list[str] = field(default_factory=list)

    def passed(self, phase: str, count: int, elapsed: float) -> None:
        self.counts[phase] = count
        if count >= self.machines and phase not in self.phases:
            self.phases[phase] = elapsed


def say(line: str) -> None:
    """A progress line, with the seconds since the run began."""
    print(f"[{time.monotonic() - _T0:6.1f}] {line}", flush=True)


# --- a cluster to install into ------------------------------------------------


@dataclass
class Cluster:
    root: Root
    owner_key: Path
    access: OwnerAccess
    #: The file ``metropolis owner info --out`` writes.
    info: Path
    ticket: bytes


@contextlib.asynccontextmanager
async def bootstrap(folder: Path, address: str) -> AsyncIterator[Cluster]:
    """A new cluster whose first node runs on ``address`` in ``folder`` (new).
    At the node's default status interval: the curator takes a node as
    healthy while its last status push is at most twice that old, and the
    registered nodes (started as the agent starts them) push at their
    default interval, the same."""
    os.makedirs(folder)
    root = Root(folder / "n1")
    owner_key = folder / "owner.pem"
    log = folder / "bootstrap.log"
    argv = [
        sys.executable, "-m", "metropolis", "node", "bootstrap", "--root", str(root.path),
        "--address", address, "--owner-key-out", str(owner_key), "--insecure-seal",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        with trio.fail_after(300):
            while LEADS not in log.read_text(errors="replace"):
                if process.poll() is not None:
                    raise RuntimeError(f"the bootstrap node exited:\n{log.read_text()[-2000:]}")
                await trio.sleep(0.1)
        access = load_owner(root, load_owner_key(owner_key))
        async with access.open() as owner:
            ticket = await owner.ticket()
            info = await owner.info()
        info_path = folder / "cluster.pb"
        info_path.write_bytes(bytes(info))
        yield Cluster(root, owner_key, access, info_path, ticket)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(30):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def node_parameters(cluster: Cluster) -> bytes:
    """The NodeParameters both paths give their nodes."""
    info = parameters.read_cluster_info(cluster.info)
    owner = owner_public_key(cluster.owner_key.read_bytes(), str(cluster.owner_key))
    return parameters.encode(parameters.register_parameters(info, cluster.ticket, owner))


def install_plan(cluster: Cluster, images: str, image: Path) -> Plan:
    """What the product's path asks each machine to install: ``image``
    (named by its digest, as built) from the image server at ``images``
    over plain HTTP onto its loopback disk, with `node_parameters`."""
    return Plan(
        node_parameters=node_parameters(cluster),
        image=image_from_server(
            images, "sha256:" + image.name.removesuffix(".pyz"), plain_http=True
        ),
        root_device="disk0",
    )


async def nodes_by_address(cluster: Cluster) -> dict[str, NodeRow]:
    async with cluster.access.open() as owner:
        return {r.address: r for r in await owner.nodes() if r.address}


def healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


async def watch(
    cluster: Cluster,
    hosts: list[str],
    progress: Progress,
    start: float,
    extra: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Poll until every node on ``hosts`` is UP and HEALTHY (phases on the
    way), or until a machine cannot finish (``progress.failures``)."""
    while not progress.failures:
        elapsed = trio.current_time() - start
        try:
            rows = await nodes_by_address(cluster)
        except Exception as e:  # the curators busy: look again
            progress.error = f"GetNodes: {e}"
            rows = {}
        else:
            progress.error = ""
        if extra is not None:
            await extra(elapsed)
        if not progress.error:
            # A NEW node has pushed no status, so no address yet: approved
            # here means approved and its first status pushed.
            mine = [rows.get(h) for h in hosts]
            progress.passed(
                "approved", sum(r is not None and r.state != "NEW" for r in mine), elapsed
            )
            progress.passed("up", sum(r is not None and r.state == "UP" for r in mine), elapsed)
            done = sum(healthy(r) for r in mine)
            progress.passed("healthy", done, elapsed)
            if done == len(hosts):
                progress.total = elapsed
                return
        await trio.sleep(POLL)


def processes_under(folder: Path) -> list[int]:
    """Pids of processes whose command line names a path under ``folder``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", pid, "cmdline").read_bytes()
        except OSError:
            continue
        if str(folder).encode() in cmdline:
            found.append(int(pid))
    return found


async def reap(folder: Path, bound: float = 30.0) -> None:
    """Wait until nothing runs from ``folder`` (the paths SIGTERMed their
    nodes); SIGKILL what is left after ``bound`` seconds."""
    with trio.move_on_after(bound):
        while processes_under(folder):  # noqa: ASYNC110 (other processes' state)
            await trio.sleep(0.2)
    for pid in processes_under(folder):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# --- the product's path -----------------------------------------------------------


async def take_over(
    nursery: trio.Nursery,
    conn: bmdb.Connection,
    fleet: Fleet,
    key: SSHKey,
    machines_file: Path,
    *,
    heartbeat_interval: float,
) -> list[uuid.UUID]:
    """Have ``fleet`` taken over as ``python -m shepherd`` does it (setup, not
    timed): listed in ``machines_file`` for the static provider, the agent
    callback server and the initializer (`TAKEOVER_PARALLELISM` machines at
    once) started in ``nursery``, the agents heartbeating every
    ``heartbeat_interval`` seconds. Returns the machines' ids, in the
    fleet's order, once each has reported its hardware (callers bound the
    wait, `trio.fail_after`)."""
    provider_ids = write_machines_file(machines_file, fleet.machines)
    provider = StaticProvider.from_file(machines_file)
    await sync_provided(conn, provider)
    binds = await nursery.start(
        lambda task_status: run_agent_server(
            conn, AgentServerConfig(listen="127.0.0.1:0"), task_status=task_status
        )
    )
    config = agent_config(
        port_of(binds[0]),
        ssh_connect_timeout=10.0,
        ssh_exec_timeout=120.0,
        heartbeat_interval=heartbeat_interval,
        heartbeat_backoff_cap=HEARTBEAT_BACKOFF_CAP,
    )
    ssh = SSHClient(key, username="root", connect_timeout=config.ssh_connect_timeout)
    start_control_loop(
        nursery,
        conn,
        Initializer(provider, ssh, config),
        parallelism=TAKEOVER_PARALLELISM,
        limiter=RateLimiter(Rate(interval=0.01, burst=TAKEOVER_PARALLELISM)),
    )
    while True:
        rows = await conn.transact(lambda q: q.machines())
        if len(rows) == len(provider_ids) and all(r.has_hardware_report for r in rows):
            break
        await trio.sleep(POLL)
    by_provider = {r.provided.provider_id: r.machine_id for r in rows if r.provided is not None}
    return [by_provider[p] for p in provider_ids]


async def product_path(
    args: argparse.Namespace, work: Path, built: BuiltImage, postgres: LocalPostgres
) -> Progress:
    image = built.path
    hosts = loopback_addresses(args.machines, block=args.loopback_block)
    progress = Progress(args.machines)
    key = SSHKey.generate()
    os.environ["SHIV_ROOT"] = str(work / "shiv")  # the agents' nodes inherit it
    postgres.admin("CREATE DATABASE bench_install")
    try:
        async with (
            open_fleet(
                work / "fleet", count=args.machines, authorized_key=key.authorized_key, hosts=hosts
            ) as f,
            bmdb.open_connection(postgres.url("bench_install"), migrate=True) as conn,
            bootstrap(work / "cluster", first_node_address(args.loopback_block)) as cluster,
            trio.open_nursery() as nursery,
        ):
            assert [m.host for m in f.machines] == hosts
            say("product: cluster up; taking the fleet over")
            images: str = await nursery.start(
                serve_images, ImageServerConfig("127.0.0.1:0", image.parent)
            )
            progress.download_alone = await download_alone(images, image, built.size)
            with trio.fail_after(args.timeout):
                machine_ids = await take_over(
                    nursery, conn, f, key, work / "machines.toml",
                    heartbeat_interval=args.heartbeat_interval,
                )  # fmt: skip
            plan = install_plan(cluster, images, image)
            say(f"product: {args.machines} machines taken over; installing")

            start = trio.current_time()
            decisions = await install(conn, plan, machines=machine_ids)
            refused = [d for d in decisions if d.refused is not None]
            if refused:
                raise RuntimeError(f"install refused: {refused[0].line(dry_run=False)}")
            progress.passed("requested", args.machines, trio.current_time() - start)
            nursery.start_soon(run_approver, cluster.access, conn, args.approve_interval)

            async def installed(elapsed: float) -> None:
                async def states(q: Queries) -> list[InstallState | None]:
                    out = []
                    for mid in machine_ids:
                        got = await q.os_installation(mid)
                        out.append(None if got is None else got.state)
                    return out

                got = await conn.transact(states)
                progress.passed("installed", got.count(InstallState.INSTALLED), elapsed)
                failed = got.count(InstallState.INSTALL_FAILED)
                if failed:
                    progress.failures.append(f"{failed} install(s) failed; see the agents' logs")

            with trio.move_on_after(args.timeout):
                await watch(cluster, hosts, progress, start, installed)
            if progress.total is None and not progress.failures:
                progress.failures.append(f"not all healthy within {args.timeout:g} s")
            for machine in f.machines:
                log = machine.root / "root" / "agent.log"
                found = (
                    _AGENT_DOWNLOAD.search(log.read_text(errors="replace"))
                    if log.exists()
                    else None
                )
                if found:
                    progress.downloads.append(float(found.group(2)))
            nursery.cancel_scope.cancel()
    finally:
        say("product: stopping")
        with trio.CancelScope(shield=True):
            for disk in (work / "fleet").glob(f"*/{DISK}"):
                stop_node(disk)
            await reap(work)
            os.environ.pop("SHIV_ROOT", None)
        say("product: stopped")
    return progress


async def download_alone(server: str, image: Path, expected: int) -> float:
    """Seconds one client takes to GET the whole image (``expected`` bytes)
    from the image server."""
    url = f"{server}/images/sha256/{image.name.removesuffix('.pyz')}"
    started = time.perf_counter()
    size = 0
    async with httpx.AsyncClient(timeout=60) as client, client.stream("GET", url) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            size += len(chunk)
    if size != expected:
        raise RuntimeError(f"downloaded {size} bytes of {expected}")
    return time.perf_counter() - started


# --- the same steps by hand, with OpenSSH -----------------------------------------


async def _run(argv: list[str], what: str, stdin: bytes = b"") -> bytes:
    done = await trio.run_process(
        argv, stdin=stdin, capture_stdout=True, capture_stderr=True, check=False
    )
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"{what}: exit {done.returncode}: {said[-500:]}")
    return bytes(done.stdout)


@dataclass
class ByHand:
    """What the operator has at hand: the cluster, the files, the SSH login."""

    cluster: Cluster
    image: Path
    digest: str
    parameters: Path
    key: Path
    port: int
    folders: Path
    shiv: Path
    deadline: float
    rng: random.Random = field(default_factory=random.Random)
    #: Machines whose node the owner approved.
    approved: set[int] = field(default_factory=set)


async def by_hand_one(index: int, host: str, hand: ByHand, progress: Progress) -> None:
    folder = hand.folders / f"m{index:02d}"
    control = hand.folders / f"ctl-{index}"
    common = [
        "-i", str(hand.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR", "-o", f"ControlPath={control}",
    ]  # fmt: skip
    ssh = ["ssh", *common, "-p", str(hand.port)]
    login = "root@127.0.0.1"
    await _run(
        [*ssh, "-o", "ControlMaster=yes", "-o", "ControlPersist=yes", "-f", "-N", login],
        "ssh -M",
    )
    try:
        # Copy the image and the parameters over the one connection.
        batch = hand.folders / f"batch-{index}"
        batch.write_text(
            f"-mkdir {folder}\nput {hand.image} {folder}/image.pyz\n"
            f"put {hand.parameters} {folder}/node-parameters.pb\n"
        )
        started = trio.current_time()
        await _run(["sftp", *common, "-P", str(hand.port), "-b", str(batch), login], "sftp")
        progress.downloads.append(trio.current_time() - started)
        said = await _run([*ssh, login, f"sha256sum {folder}/image.pyz"], "sha256sum")
        if said.split()[0].decode() != hand.digest:
            raise RuntimeError(f"machine {index}: the copied image's digest differs")
        # Start the node detached, as the agent does; it announces its key.
        register = shlex.join(
            [
                "python3", f"{folder}/image.pyz", "node", "register",
                "--parameters", f"{folder}/node-parameters.pb", "--root", f"{folder}/metropolis",
                "--address", host, "--insecure-seal", "--announce-key", f"{folder}/node.key.pub",
            ]
        )  # fmt: skip
        command = (
            f"rm -rf {folder}/metropolis {folder}/node.key.pub && "
            f"mkdir -m 700 {folder}/metropolis && cd {folder} && "
            f"(SHIV_ROOT={hand.shiv} setsid {register} >node.log 2>&1 </dev/null & "
            "echo $! >node.pid)"
        )
        alive = f"kill -0 $(cat {folder}/node.pid) 2>/dev/null && echo yes; true"
        for attempt in range(MAX_REGISTERS):
            await _run([*ssh, login, command], "node register")
            polls = Retrier(ExponentialBackoff(0.1, 2.0, jitter=FULL_JITTER), hand.rng)
            while True:
                key = await _run(
                    [*ssh, login, f"cat {folder}/node.key.pub 2>/dev/null; true"], "cat"
                )
                if len(key) == 32:
                    break
                if trio.current_time() > hand.deadline:
                    raise RuntimeError("no node key announced")
                await polls.sleep()
            if attempt == 0:
                progress.counts["started"] = progress.counts.get("started", 0) + 1
            node = identity.node_id(key)
            owner = [
                sys.executable, "-m", "metropolis", "owner", "--root", str(hand.cluster.root.path),
                "--owner-key", str(hand.cluster.owner_key), "approve", node,
            ]  # fmt: skip
            retries = Retrier(ExponentialBackoff(0.5, 5.0, jitter=FULL_JITTER), hand.rng)
            approved = False
            while not approved:
                try:
                    await _run(owner, "owner approve")
                    approved = True
                except RuntimeError:  # not registered yet (or curators busy): again
                    if trio.current_time() > hand.deadline:
                        raise
                    if b"yes" not in await _run([*ssh, login, alive], "kill -0"):
                        break  # the node gave up before it registered: start it again
                    await retries.sleep()
            if approved:
                break
            progress.restarts += 1
        else:
            raise RuntimeError(f"node register failed {MAX_REGISTERS} times, see {folder}/node.log")
        progress.counts["approve ran"] = progress.counts.get("approve ran", 0) + 1
        hand.approved.add(index)
    finally:
        with trio.CancelScope(shield=True):
            await trio.run_process(
                [*ssh, "-O", "exit", login], capture_stdout=True, capture_stderr=True, check=False
            )


async def by_hand_path(args: argparse.Namespace, work: Path, image: Path) -> Progress:
    hosts = loopback_addresses(args.machines, block=args.loopback_block)
    progress = Progress(args.machines)
    os.makedirs(work)
    key = SSHKey.generate()
    key_path = work / "id_ed25519"
    key_path.write_bytes(key.openssh_private)
    key_path.chmod(0o600)
    sshd_process, sshd = start_sshd(work / "sshd", [key.authorized_key])
    folders = sshd.root
    try:
        async with bootstrap(work / "cluster", first_node_address(args.loopback_block)) as cluster:
            params = work / "node-parameters.pb"
            params.write_bytes(node_parameters(cluster))
            say(
                f"by hand: cluster up; {args.machines} machines, {args.by_hand_parallelism} at once"
            )
            start = trio.current_time()
            hand = ByHand(
                cluster=cluster,
                image=image,
                digest=image.name.removesuffix(".pyz"),
                parameters=params,
                key=key_path,
                port=sshd.port,
                folders=folders,
                shiv=work / "shiv",
                deadline=start + args.timeout,
            )
            limiter = trio.CapacityLimiter(args.by_hand_parallelism)

            async def one(index: int, host: str) -> None:
                async with limiter:
                    try:
                        await by_hand_one(index, host, hand, progress)
                    except RuntimeError as e:  # measured as not finished, said why
                        progress.failures.append(f"machine {index}: {e}")

            async def steps(elapsed: float) -> None:
                for phase in ("started", "approve ran"):
                    progress.passed(phase, progress.counts.get(phase, 0), elapsed)
                for index in sorted(hand.approved):
                    if node_pid(folders / f"m{index:02d}") is None:
                        hand.approved.discard(index)
                        progress.failures.append(
                            f"machine {index}: its node exited after its approval "
                            f"(see m{index:02d}/node.log)"
                        )

            with trio.move_on_after(args.timeout):
                async with trio.open_nursery() as nursery:
                    for index, host in enumerate(hosts):
                        nursery.start_soon(one, index, host)
                    await watch(cluster, hosts, progress, start, steps)
            if progress.total is None and not progress.failures:
                progress.failures.append(f"not all healthy within {args.timeout:g} s")
    finally:
        say("by hand: stopping")
        with trio.CancelScope(shield=True):
            stop_sshd(sshd_process)  # before the wait: its command line names ``work``
            for folder in folders.glob("m*"):
                stop_node(folder)
            await reap(work)
        say("by hand: stopped")
    return progress


# --- the run ------------------------------------------------------------------------


def run_in_scratch(
    main_async: Callable[[argparse.Namespace, Path], Awaitable[int]],
    args: argparse.Namespace,
    prefix: str,
) -> int:
    """``main_async(args, work)`` under Trio, ``work`` a new folder in /tmp
    named from ``prefix`` (short: a node's etcd socket lies deep inside it,
    107 bytes at most), removed after, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        return trio.run(main_async, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _total(p: Progress) -> str:
    return f"{p.total:.1f} s" if p.total is not None else "did not finish"


def _phases(name: str, p: Progress) -> list[str]:
    lines = [f"{name}"]
    for phase, count in p.counts.items():
        at = p.phases.get(phase)
        when = f"{at:8.1f} s" if at is not None else "       - "
        lines.append(f"  {phase:<12} {count:>3}/{p.machines} machines   all by {when}")
    if p.downloads:
        lines.append(
            f"  image copy per machine: median {median(p.downloads):.2f} s, "
            f"max {max(p.downloads):.2f} s ({len(p.downloads)} machines)"
        )
    if p.restarts:
        lines.append(f"  nodes started again (they exited before registering): {p.restarts}")
    for failure in p.failures[:5]:
        lines.append(f"  failed: {failure}")
    if p.total is None and p.error:
        lines.append(f"  last look at the cluster: {p.error}")
    return lines


async def main_async(args: argparse.Namespace, work: Path) -> int:
    images = work / "images"
    images.mkdir()
    started = time.perf_counter()
    built = build_image(images, default_etcd())
    build_seconds = time.perf_counter() - started
    size = built.size
    say(f"image build: {build_seconds:.1f} s ({size / 1e6:.1f} MB, {built.path.name})")

    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    postgres.create()
    postgres.start()
    try:
        async with trio_asyncio.open_loop():
            product = await product_path(args, work / "p", built, postgres)
    finally:
        postgres.stop()
        shutil.rmtree(postgres.root, ignore_errors=True)
    say(f"product: {_total(product)}")
    by_hand = await by_hand_path(args, work / "h", built.path)
    say(f"by hand: {_total(by_hand)}")

    alone = product.download_alone
    print(f"\n{args.machines} machines, {os.cpu_count()} CPUs, image {size / 1e6:.1f} MB")
    print(f"image build:                    {build_seconds:8.1f} s")
    if alone is not None:
        print(f"image download, one client:     {alone:8.2f} s ({size / alone / 1e6:.0f} MB/s)")
    print(
        f"product: agents heartbeat every {args.heartbeat_interval:g} s, approver every "
        f"{args.approve_interval:g} s; by hand: {args.by_hand_parallelism} machines at once"
    )
    print()
    for line in _phases(PRODUCT, product) + _phases(BY_HAND, by_hand):
        print(line)
    print()
    print(f"{'path':<48} {'request -> all healthy':>24}")
    for name, p in ((PRODUCT, product), (BY_HAND, by_hand)):
        print(f"{name:<48} {_total(p):>24}")
    if product.total is not None and by_hand.total is not None:
        ratio = by_hand.total / product.total
        print(f"install: by hand / product (time ratio): {ratio:.2f} (goal >= 2)")
        report("install", f"{args.machines} machines: by-hand time / product time", ratio, ">= 2")
        return 0
    print("install: by hand / product (time ratio): not measured, a path did not finish")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=20)
    parser.add_argument(
        "--by-hand-parallelism",
        type=int,
        default=4,
        help="machines done by hand at once (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per path, seconds")
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=HEARTBEAT_INTERVAL,
        help="the agents', seconds (default: the Shepherd's, %(default)s)",
    )
    parser.add_argument(
        "--approve-interval",
        type=float,
        default=APPROVE_INTERVAL,
        help="the approver's, seconds (default: the Shepherd's, %(default)s)",
    )
    parser.add_argument(
        "--loopback-block",
        type=int,
        default=0,
        metavar="B",
        help="machines on 127.B.0.2 on, the first node on 127.B.1.1 (default: %(default)s);"
        " runs in different blocks can share a host",
    )
    parser.add_argument(
        "--real-machines",
        action="store_true",
        help="on nspawn machines with loop disks instead (bench.install_real: install, reboot, "
        "wipe); --machines and --by-hand-parallelism then default to 5",
    )
    smoke = {
        "machines": 1,
        "by_hand_parallelism": 1,
        "timeout": 240.0,
        "heartbeat_interval": 1.0,
        "approve_interval": 0.5,
    }
    args = parse_args(parser, smoke)
    if args.real_machines:
        from bench import install_real

        for name in ("machines", "by_hand_parallelism"):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, install_real.DEFAULT_MACHINES)
        return install_real.run(args)
    if args.machines < 1:
        parser.error("--machines must be at least 1")
    if args.by_hand_parallelism < 1:
        parser.error("--by-hand-parallelism must be at least 1")
    if not 0 <= args.loopback_block < LOOPBACK_BLOCKS:
        parser.error(f"--loopback-block must be in 0-{LOOPBACK_BLOCKS - 1}")
    return run_in_scratch(main_async, args, "bi-")


if __name__ == "__main__":
    raise SystemExit(main())
