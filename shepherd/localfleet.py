"""A fleet of real SSH servers on loopback, one per simulated machine (asyncssh).

Used by the demo (``python -m shepherd.demo``), and where a test or
benchmark needs more machines than one OpenSSH sshd can stand in for. Each
machine is an asyncssh server with its own Ed25519 host key, accepting one
client key for ``root``, serving SFTP and running commands for real as
subprocesses.

Each machine has its own loopback address, 127.0.0.N with N from 2 up
(`loopback_addresses`; Linux routes all of 127.0.0.0/8 to ``lo``), and its
SSH server listens there: the Metropolis node an install starts on a
machine listens on the node's fixed ports (7834, 7835, 7837) at the
machine's address, so machines sharing one address could run one node
only. 127.0.0.1 stays the host's own (the Shepherd, its servers).

A machine's filesystem is a directory (its ``root``): SFTP is chrooted there,
and an absolute program path in a command is resolved inside it the same way,
so ``/agent`` uploaded by SFTP is what ``/agent`` runs. The program's working
directory is the root too. Nothing else is translated. Each root holds one
loopback disk, ``root/disks/disk0/`` (the folder an agent uploaded to
``/root/agent`` reports as its disk ``disk0`` and installs the node onto).
`agent_config` is how the Shepherd deploys its agents onto such machines.

From Trio (inside ``trio_asyncio.open_loop()``)::

    async with open_fleet(tmp_path, count=100, authorized_key=key) as fleet:
        fleet.machines[0].port ...

As a separate process (the benchmark), ``python -m shepherd.localfleet DIR
COUNT AUTHORIZED_KEY`` serves until killed and prints one JSON line per
machine (host, port, root) and then ``ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import os
import shlex
import signal
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_start import AgentConfig
from shepherd.asyncssh_import import asyncssh


@dataclass
class FleetMachine:
    """One simulated machine and what happened to it."""

    #: Its own loopback address, where its SSH server (and later its node) listens.
    host: str
    port: int
    root: Path
    #: Public host key, SSH wire format.
    host_key: bytes
    #: Commands started (one per agent run).
    execs: int = 0
    #: Connections currently open / closed so far.
    open_connections: int = 0
    closed_connections: int = 0
    #: Commands whose session closed before they exited (they were killed).
    killed: int = 0
    _acceptor: asyncssh.SSHAcceptor | None = field(default=None, repr=False)
    #: Commands running now. The fleet waits for each before it closes: the
    #: wait for a child's exit runs in a thread that reports to the Trio run
    #: (trio_asyncio), and must not outlive it.
    _children: set[asyncio.subprocess.Process] = field(default_factory=set, repr=False)
    #: Commands being spawned now: the fleet waits for them too, so that
    #: one spawned while it stops is in ``_children`` before it reaps them.
    _spawning: set[asyncio.Future[asyncio.subprocess.Process]] = field(
        default_factory=set, repr=False
    )
    #: The transports of commands spawned, exited or not. One whose pipe a
    #: detached grandchild still holds stays open after its command exits;
    #: the fleet closes it inside the loop when it stops, since a transport
    #: collected after the loop closed reports "Event loop is closed".
    _transports: weakref.WeakSet[asyncio.BaseTransport] = field(
        default_factory=weakref.WeakSet, repr=False
    )
    #: Set once the fleet stops: no command starts after that.
    _stopping: bool = field(default=False, repr=False)


@dataclass
class Fleet:
    machines: list[FleetMachine]


class _Server(asyncssh.SSHServer):
    def __init__(self, machine: FleetMachine) -> None:
        self._machine = machine

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._machine.open_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._machine.open_connections -= 1
        self._machine.closed_connections += 1


async def _run_command(machine: FleetMachine, process: asyncssh.SSHServerProcess[bytes]) -> None:
    argv = shlex.split(process.command or "")
    if not argv:
        process.stderr.write(b"no interactive shells here\n")
        process.exit(1)
        return
    if argv[0].startswith("/"):
        argv[0] = str(machine.root) + argv[0]
    stdin = await process.stdin.read()
    if machine._stopping:
        process.stderr.write(b"the machine is shutting down\n")
        process.exit(255)
        return
    machine.execs += 1
    spawn = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *argv,
            cwd=machine.root,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    )
    machine._spawning.add(spawn)
    spawn.add_done_callback(lambda done: _spawned(machine, done))
    try:
        child = await asyncio.shield(spawn)
    except OSError as exc:
        process.stderr.write(f"{argv[0]}: {exc.strerror}\n".encode())
        process.exit(127)
        return
    communicate = asyncio.ensure_future(child.communicate(stdin))
    closed = asyncio.ensure_future(process.wait_closed())
    await asyncio.wait({communicate, closed}, return_when=asyncio.FIRST_COMPLETED)
    if communicate.done():
        closed.cancel()
        stdout, stderr = communicate.result()
        process.stdout.write(stdout)
        process.stderr.write(stderr)
        process.exit(child.returncode if child.returncode is not None else 255)
    else:
        # The client went away: do what sshd's session teardown amounts to
        # for a command that would otherwise run forever.
        machine.killed += 1
        kill_unreaped(child)
        await communicate


def kill_unreaped(child: asyncio.subprocess.Process) -> None:
    """SIGKILL ``child`` unless its exit is known, without reaping it.

    ``child.kill()`` asks Popen, which first polls the process (waitpid
    with WNOHANG) and so reaps one that has just exited; trio_asyncio's
    watcher thread, blocked in its own waitpid for that pid, then fails
    with ChildProcessError, which ends the whole Trio-asyncio loop (the
    demo exited 1 at a Ctrl-C under load). A signal sent with os.kill
    leaves the reaping to the watcher; a zombie takes it harmlessly.
    """
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)


def _spawned(machine: FleetMachine, spawn: asyncio.Future[asyncio.subprocess.Process]) -> None:
    """Track a spawned command until it exits (whether or not the session
    that asked for it is still there)."""
    machine._spawning.discard(spawn)
    if spawn.cancelled() or spawn.exception() is not None:
        return
    child = spawn.result()
    machine._children.add(child)
    transport: asyncio.BaseTransport | None = getattr(child, "_transport", None)
    if transport is not None:
        machine._transports.add(transport)
    child_exited = asyncio.ensure_future(child.wait())
    child_exited.add_done_callback(lambda _: machine._children.discard(child))


async def _start_machine(
    root: Path, authorized_key: str, host: str = "127.0.0.1", port: int = 0
) -> FleetMachine:
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    machine = FleetMachine(host=host, port=0, root=root, host_key=host_key.public_data)

    def process_factory(process: asyncssh.SSHServerProcess[bytes]) -> object:
        return _run_command(machine, process)

    acceptor = await asyncssh.create_server(
        lambda: _Server(machine),
        host,
        port,
        server_host_keys=[host_key],
        authorized_client_keys=asyncssh.import_authorized_keys(authorized_key),
        sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=str(root).encode()),
        process_factory=process_factory,
        encoding=None,
        allow_scp=False,
    )
    machine.port = acceptor.sockets[0].getsockname()[1]
    machine._acceptor = acceptor
    return machine


#: The loopback disk each machine has (`shepherd.agent.disks`), under its root.
DISK = Path("root") / "disks" / "disk0"

#: Where the Shepherd uploads each machine's agent to and runs it from: in
#: the machine's ``root/`` folder, which holds its disk (`DISK`) too.
AGENT_PATH = "/root/agent"


def agent_config(
    agent_server_port: int,
    *,
    ssh_connect_timeout: float,
    ssh_exec_timeout: float,
    heartbeat_interval: float,
    heartbeat_backoff_cap: float,
    install_download_deadline: float | None = None,
    install_backoff_start: float | None = None,
    install_backoff_cap: float | None = None,
) -> AgentConfig:
    """How agents are deployed onto this fleet's machines: this checkout's
    agent (`agent_zipapp`) at `AGENT_PATH`, heartbeating over plain HTTP to
    the agent callback server on 127.0.0.1 at ``agent_server_port``; the
    bounds as given (`AgentConfig`). ValueError if one is not allowed."""
    return AgentConfig(
        executable=agent_zipapp(),
        target_path=AGENT_PATH,
        endpoint=f"http://127.0.0.1:{agent_server_port}",
        endpoint_ca_certificate=b"",
        ssh_connect_timeout=ssh_connect_timeout,
        ssh_exec_timeout=ssh_exec_timeout,
        heartbeat_interval=heartbeat_interval,
        heartbeat_backoff_cap=heartbeat_backoff_cap,
        install_download_deadline=install_download_deadline,
        install_backoff_start=install_backoff_start,
        install_backoff_cap=install_backoff_cap,
    )


#: How many blocks (/16s) 127.0.0.0/8 holds; see `loopback_addresses`.
LOOPBACK_BLOCKS = 256


def _block_base(block: int) -> int:
    if not 0 <= block < LOOPBACK_BLOCKS:
        raise ValueError(f"loopback block {block} is not in 0-{LOOPBACK_BLOCKS - 1}")
    return int(ipaddress.IPv4Address("127.0.0.0")) + (block << 16)


def loopback_addresses(count: int, first: int = 2, *, block: int = 0) -> list[str]:
    """``count`` loopback addresses from 127.``block``.0.``first`` on (past .255
    they go on in 127.``block``.1.x: all of 127.0.0.0/8 is loopback).

    ``block`` picks one /16 of 127.0.0.0/8: fleets (and the nodes installed
    on them, on the nodes' fixed ports) in different blocks can run on one
    host at once. Block 0 (127.0.0.N) is the default.
    """
    base = _block_base(block) + first
    if first < 1 or base + count > int(ipaddress.IPv4Address("127.255.255.255")):
        raise ValueError(f"no {count} loopback addresses from 127.{block}.0.{first}")
    return [str(ipaddress.IPv4Address(base + i)) for i in range(count)]


def first_node_address(block: int = 0) -> str:
    """Where the first node of a cluster beside a fleet in ``block`` runs:
    127.``block``.1.1, not 127.0.0.1 (the Shepherd's servers) nor a
    machine's 127.``block``.0.N."""
    return str(ipaddress.IPv4Address(_block_base(block) + 257))


def machine_root(directory: Path, index: int, prefix: str = "machine-") -> Path:
    """The root folder of machine ``index`` of a fleet in ``directory``."""
    return directory / f"{prefix}{index:04d}"


def _make_roots(directory: Path, count: int, prefix: str) -> list[Path]:
    roots = [machine_root(directory, i, prefix) for i in range(count)]
    for root in roots:
        (root / DISK).mkdir(parents=True, exist_ok=True)
    return roots


async def _start(roots: list[Path], hosts: list[str], authorized_key: str, port: int) -> Fleet:
    """Serve a machine at each of ``roots`` on the host of ``hosts`` beside it."""
    return Fleet(
        [
            await _start_machine(root, authorized_key, host, port)
            for root, host in zip(roots, hosts, strict=True)
        ]
    )


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Wait (from Trio) until ``predicate()`` holds. Callers bound it with a timeout.

    The fleet's counters change in asyncio callbacks, which cannot set a Trio
    event, so this polls.
    """
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.01)


def agent_pid(target: Path) -> int | None:
    """The pid of the detached agent running from ``target``: the one its pid
    file (``target`` + ``.pid``) names, if that process was started from
    ``target`` (a stale file may name a pid reused by something else)."""
    try:
        pid = int(target.with_name(target.name + ".pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if str(target).encode() in cmdline else None


def stop_agent(target: Path) -> None:
    """SIGTERM the detached agent running from ``target``, if any."""
    pid = agent_pid(target)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def node_pid(disk: Path) -> int | None:
    """The pid of the node an install started from ``disk`` (its ``node.pid``),
    if that process runs the disk's ``image.pyz`` (or, after an upgrade, the
    image of slot B, ``image-b.pyz``)."""
    try:
        pid = int((disk / "node.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    images = {str(disk / name).encode() for name in ("image.pyz", "image-b.pyz")}
    return pid if images & set(cmdline) else None


def stop_node(disk: Path) -> None:
    """SIGTERM the node started from ``disk``, if any."""
    pid = node_pid(disk)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


async def _stop(fleet: Fleet) -> None:
    for machine in fleet.machines:
        machine._stopping = True
        if machine._acceptor is not None:
            machine._acceptor.close()
            await machine._acceptor.wait_closed()
        # A command still running (one a Ctrl-C to the process group did
        # not end yet) is killed and reaped here, inside the loop; one
        # being spawned first becomes one of them.
        if machine._spawning:
            await asyncio.wait(set(machine._spawning))
        for child in list(machine._children):
            kill_unreaped(child)
            await child.wait()
        # An agent detaches from the SSH session that started it (on a real
        # machine it outlives the Shepherd's connection), so closing the
        # server does not end it, nor the node an agent started (which
        # outlives its agent too); a machine that goes away takes both
        # along, found by their pid files anywhere under its root.
        for pid_file in machine.root.rglob("*.pid"):
            if pid_file.name == "node.pid":
                stop_node(pid_file.parent)
            else:
                stop_agent(pid_file.with_name(pid_file.name.removesuffix(".pid")))


def _close_transports(fleet: Fleet) -> None:
    """Close the fleet's command transports, and collect any that only a
    reference cycle still holds, while the loop runs.

    A subprocess transport is never closed by its process's exit, only by
    ``close()`` or its finalizer; one finalized after the loop closed (a
    cycle through a traceback keeps it until the interpreter's last
    collection) reports "Event loop is closed" on stderr. Synchronous, so
    that it runs even when the fleet's stop was cancelled.
    """
    for machine in fleet.machines:
        for transport in list(machine._transports):
            transport.close()
    gc.collect()


@asynccontextmanager
async def open_fleet(
    directory: Path,
    *,
    count: int,
    authorized_key: str,
    hosts: list[str] | None = None,
    port: int = 0,
    prefix: str = "machine-",
) -> AsyncIterator[Fleet]:
    """Serve ``count`` machines under ``directory`` for the duration of the block.

    Leaving the block closes the servers and stops (SIGTERM) the agents
    and nodes running from the machines' roots.

    By default machine i listens on a port of its own of 127.0.0.(2+i)
    (`loopback_addresses`); two fleets open at once need ``hosts`` for one
    of them (another block of `loopback_addresses`, say). With ``hosts``
    (one loopback address per machine) and ``port``, they all listen on the
    same port of their addresses, as real machines do on port 22 (a provider
    that only knows addresses, like Equinix, can then reach them). Machine
    i's root is ``directory/<prefix><i, 4 digits>`` (`machine_root`): a
    shorter ``prefix`` keeps the UNIX socket paths of the nodes installed
    there short.
    """
    roots = _make_roots(directory, count, prefix)
    hosts = hosts or loopback_addresses(count)
    fleet = await trio_asyncio.aio_as_trio(_start)(roots, hosts, authorized_key, port)
    try:
        yield fleet
    finally:
        try:
            await trio_asyncio.aio_as_trio(_stop)(fleet)
        finally:
            _close_transports(fleet)


async def _serve_forever(directory: Path, count: int, authorized_key: str) -> None:
    roots = _make_roots(directory, count, "machine-")
    fleet = await _start(roots, loopback_addresses(count), authorized_key, 0)
    for machine in fleet.machines:
        line = json.dumps({"host": machine.host, "port": machine.port, "root": str(machine.root)})
        sys.stdout.write(line + "\n")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_serve_forever(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
