"""A whole cluster on this machine's loopback addresses, each node its own process.

For benchmarks and tests that need a real cluster (``bench.cli``, the
tests' module-wide cluster): node 1 bootstraps on the first address, the
others register with the owner's ticket, are approved, and (up to
``voters``) are granted ConsensusMember, each a ``python -m metropolis node``
process with its own etcd, as an operator would run them::

    cluster = await start_cluster(work, ("127.0.0.1", "127.0.0.2", "127.0.0.3"))
    try:
        cluster.owner_key, cluster.cluster_file, cluster.nodes[0].root ...
    finally:
        await cluster.stop()

The processes are not tied to a Trio nursery, so that a cluster can
outlive the ``trio.run`` that started it (a test module's fixture starts
it once for all the module's tests, each in its own ``trio.run``); every
node runs in a session of its own (a terminal's Ctrl-C to the caller does
not reach it) and logs to ``work/nI.log``. Every node listens on the same
free ports of its own address. The steps wait on the cluster's own state
(the owner's calls, etcd's member list), polled with backoff since it
lives in other processes, each bounded by ``step_timeout``.

Errors: :class:`LocalClusterError` naming the step (and the log of a node
that exited); the nodes started so far are stopped first. Cancellation
stops them too (shielded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.backoff import ExponentialBackoff, Retrier
from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus.settings import SOCKET_NAME
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.owner import NodeRow, open_owner

__all__ = ["LocalCluster", "LocalClusterError", "LocalNode", "start_cluster"]

#: Seconds a node has after SIGTERM before it is killed.
STOP_GRACE = 15.0

#: Waits between two looks at a state that lives in other processes.
_POLL = ExponentialBackoff(initial=0.05, maximum=0.5)

#: Lines of a node's log quoted when it exits early.
_LOG_TAIL = 5


class LocalClusterError(MetropolisError):
    """A node exited, or a step did not happen in time (the nodes were stopped)."""


@dataclass
class LocalNode:
    """One node's process, root, address and log."""

    address: str
    root: Root
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def etcd_socket(self) -> Path:
        """Its etcd member's client socket (a consensus member's)."""
        return self.root.ephemeral.consensus / SOCKET_NAME


@dataclass
class LocalCluster:
    """The running nodes (node 1 bootstrapped it) and the owner's files."""

    work: Path
    owner_key: Path
    #: What ``owner info --out`` writes: the CA and directory.
    cluster_file: Path
    curator_port: int
    nodes: list[LocalNode] = field(default_factory=list)

    def key(self) -> Ed25519PrivateKey:
        """The owner's private key."""
        return pki.decode_private_key(self.owner_key.read_bytes())

    async def stop(self) -> None:
        """SIGTERM every node, SIGKILL after :data:`STOP_GRACE`; wait for all (shielded)."""
        with trio.CancelScope(shield=True):
            for node in self.nodes:
                if node.process.poll() is None:
                    node.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE):
                for node in self.nodes:
                    await trio.to_thread.run_sync(node.process.wait)
            for node in self.nodes:
                if node.process.poll() is None:
                    node.process.kill()
                    await trio.to_thread.run_sync(node.process.wait)

    def check_running(self) -> None:
        """:class:`LocalClusterError` if a node exited, quoting its log's end."""
        for node in self.nodes:
            if node.process.poll() is not None:
                tail = node.log.read_text(errors="replace").splitlines()[-_LOG_TAIL:]
                raise LocalClusterError(
                    f"node {node.address} exited with status {node.process.returncode}: "
                    + " | ".join(tail)
                )


async def start_cluster(
    work: Path,
    addresses: Sequence[str],
    *,
    voters: int = 3,
    node_args: Sequence[str] = ("--raft-tuning", "20,200", "--member-health-wait", "off"),
    step_timeout: float = 180.0,
) -> LocalCluster:
    """Start a cluster of one node per address in ``work`` (a new or empty
    folder); return once every node is UP and ``voters`` of them are etcd
    voters. ``node_args`` go to every node's bootstrap or register."""
    await trio.Path(work).mkdir(parents=True, exist_ok=True)
    ports = {name: str(free_loopback_port()) for name in ("peer", "curator", "debug")}
    common = [
        *("--peer-port", ports["peer"], "--curator-port", ports["curator"]),
        *("--debug-port", ports["debug"], "--insecure-seal", *node_args),
    ]
    cluster = LocalCluster(
        work, work / "owner.pem", work / "cluster.pb", curator_port=int(ports["curator"])
    )
    try:
        await _form(cluster, addresses, common, voters, step_timeout)
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def _form(
    cluster: LocalCluster,
    addresses: Sequence[str],
    common: list[str],
    voters: int,
    step_timeout: float,
) -> None:
    async def until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
        retrier = Retrier(_POLL)
        with trio.move_on_after(step_timeout):
            while True:
                cluster.check_running()
                try:
                    if await check():
                        return
                except MetropolisError:
                    pass  # a curator not up yet, or a leader being elected
                await retrier.sleep()
        raise LocalClusterError(f"{what}: not within {step_timeout:g} s (logs in {cluster.work})")

    first = _spawn(
        cluster,
        addresses[0],
        *("bootstrap", "--owner-key-out", str(cluster.owner_key), *common),
    )

    async def serving() -> bool:
        if not await trio.Path(cluster.owner_key).exists():
            return False
        async with open_owner(first.root, cluster.key()) as owner:
            info = await owner.info()
        directory = info.cluster_directory
        return directory is not None and bool(directory.nodes)

    await until("the first node's curator", serving)
    async with open_owner(first.root, cluster.key()) as owner:
        ticket = (await owner.ticket()).hex()
        await trio.Path(cluster.cluster_file).write_bytes(bytes(await owner.info()))
        for address in addresses[1:]:
            _spawn(
                cluster,
                address,
                *("register", "--ticket", ticket, "--directory", str(cluster.cluster_file)),
                *common,
            )

        async def rows() -> list[NodeRow]:
            return await owner.nodes()

        async def registered() -> bool:
            return sum(r.state == "NEW" for r in await rows()) == len(addresses) - 1

        await until("the others' registration", registered)
        for row in await rows():
            if row.state == "NEW":
                await owner.approve(row.node_id)

        async def up() -> bool:
            found = await rows()
            return len(found) == len(addresses) and all(
                r.state == "UP" and r.address for r in found
            )

        await until("every node up", up)
        for address in addresses[1:voters]:
            row = next(r for r in await rows() if r.address == address)
            await owner.set_roles(row.node_id, consensus_member=True)

            async def voting(address: str = address) -> bool:
                row = {r.address: r for r in await rows()}[address]
                return row.curator and row.etcd == "voter"

            await until(f"{address} a voter", voting)


def _spawn(cluster: LocalCluster, address: str, action: str, *args: str) -> LocalNode:
    index = len(cluster.nodes) + 1
    root = Root(cluster.work / f"n{index}")
    log = cluster.work / f"n{index}.log"
    argv = [sys.executable, "-m", "metropolis", "node", action, "--root", str(root.path)]
    with log.open("ab") as out:
        process = subprocess.Popen(
            [*argv, "--address", address, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=os.environ.copy(),
        )
    node = LocalNode(address, root, log, process)
    cluster.nodes.append(node)
    return node
