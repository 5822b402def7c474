"""The first node of a new cluster, as a process of its own on this machine.

For the demo (``python -m shepherd.demo``) and anything else that needs a
cluster for the loopback fleet to install its nodes into::

    async with open_first_node(root, "127.0.1.1", owner_key, log) as first:
        first.access      # the owner's OwnerAccess (curators, TLS identity)

`open_first_node` runs ``python -m metropolis node bootstrap --root ROOT
--address ADDRESS --owner-key-out OWNER_KEY --insecure-seal`` on the node's
default ports (those the nodes an agent installs use to reach it), in a
session of its own, so that a terminal's Ctrl-C to the caller's process
group does not stop it before the caller is done with it; its output goes
to ``log``. It returns once the node's curator answers the owner
(``GetClusterInfo`` listing the node in the cluster directory): until then
the node's files are missing or half-written, or the curator is not up,
which are retried with backoff, bounded by ``ready_within``
seconds.

Leaving the block stops the node (SIGTERM, then SIGKILL after
``STOP_GRACE`` seconds; shielded, so that a cancelled caller still waits
for it); its etcd exits with it. `LocalClusterError` if the node exits
before it is ready, or is not ready within ``ready_within``; either way it has
been stopped.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from common.backoff import ExponentialBackoff, Retrier
from common.processes import terminate
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.owner import OwnerAccess, load_owner, load_owner_key
from metropolis.proto.management import GetClusterInfoResponse
from shepherd.errors import ShepherdError

__all__ = ["STOP_GRACE", "FirstNode", "LocalClusterError", "open_first_node"]

#: Seconds a node has after SIGTERM before it is killed.
STOP_GRACE = 15.0

#: Waits between two checks of a node that is not ready yet.
_READY_BACKOFF = ExponentialBackoff(initial=0.1, maximum=1.0)

#: Lines of the node's log quoted when it fails.
_LOG_TAIL = 5


class LocalClusterError(ShepherdError):
    """The local first node exited, or was not ready in time (it was stopped)."""


@dataclass(frozen=True)
class FirstNode:
    """A running first node and the owner's way in."""

    root: Root
    address: str
    owner_key: Path
    access: OwnerAccess
    info: GetClusterInfoResponse
    process: trio.Process


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(lines[-_LOG_TAIL:]) or "(empty log)"


async def _ready(
    root: Root, owner_key: Path, process: trio.Process, log: Path
) -> tuple[OwnerAccess, GetClusterInfoResponse]:
    retrier = Retrier(_READY_BACKOFF)
    while True:
        if process.returncode is not None:
            raise LocalClusterError(
                f"the first node exited ({process.returncode}) before it served: {_tail(log)}"
            )
        try:
            access = load_owner(root, load_owner_key(owner_key))
            async with access.open() as owner:
                info = await owner.info()
            if info.cluster_directory is not None and info.cluster_directory.nodes:
                return access, info
        except MetropolisError:
            pass  # its files are not written yet, or its curator is not up
        await retrier.sleep()


@asynccontextmanager
async def open_first_node(
    root: Path,
    address: str,
    owner_key: Path,
    log: Path,
    *,
    ready_within: float = 60.0,
) -> AsyncIterator[FirstNode]:
    """Bootstrap a cluster with a node on ``address``; stop it on the way out.

    The node keeps its default status interval: the cluster's heartbeat
    timeout follows it (twice that), and nodes an agent installs push at
    the default interval; a shorter one here would time them out between
    two of their pushes.
    """
    argv = [
        *(sys.executable, "-m", "metropolis", "node", "bootstrap"),
        *("--root", str(root), "--address", address),
        *("--owner-key-out", str(owner_key), "--insecure-seal"),
    ]
    with log.open("ab") as out:
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    try:
        with trio.fail_after(ready_within):
            access, info = await _ready(Root(root), owner_key, process, log)
    except trio.TooSlowError:
        await terminate(process, STOP_GRACE)
        raise LocalClusterError(
            f"the first node did not serve within {ready_within:g} s: {_tail(log)}"
        ) from None
    except BaseException:
        await terminate(process, STOP_GRACE)
        raise
    try:
        yield FirstNode(Root(root), address, owner_key, access, info, process)
    finally:
        await terminate(process, STOP_GRACE)
