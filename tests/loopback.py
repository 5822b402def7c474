"""This test process's own block of loopback addresses, for the tests that
put nodes on the nodes' fixed ports.

A node listens on fixed ports (7834, 7835, 7837) at its own address, so
two tests that start nodes on the same addresses at once collide. Each
pytest-xdist worker takes a block (a /16 of 127.0.0.0/8, all loopback on
Linux) of its own (`shepherd.localfleet.loopback_addresses`). The tests of
one worker run one after another, so such a module can run on any worker.

Two test runs on one host (two people, or a run beside a helper's) must not
take the same block either, so a block is *claimed*: the process holds an
exclusive `flock` on ``<tmp>/monotrio-loopback/block-N.lock`` for as long
as it lives (the kernel lets go of it when the process ends, however it
ends). Worker gwN tries block N+1 first, one process without xdist block 1,
and each goes on to the next free block when its own is held by another run.

Block 0 (the demo's and the benchmarks' default, 127.0.0.N and 127.0.1.1)
is claimed the same way, but only by the modules of the "fixed-address"
group while they run (`claim_default_block`); a second run that reaches
them while another holds it is refused in one line naming the other run.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

from shepherd.localfleet import LOOPBACK_BLOCKS, first_node_address, loopback_addresses

__all__ = [
    "BLOCK",
    "FIRST",
    "BlockHeld",
    "claim_block",
    "claim_default_block",
    "fleet_hosts",
    "worker_block",
]

#: Where the claims' lock files live (one per block, kept: only the lock matters).
LOCK_DIR = Path(tempfile.gettempdir()) / "monotrio-loopback"


class BlockHeld(RuntimeError):
    """A loopback block this process needs is claimed by another test run."""


def worker_block(worker: str | None = None) -> int:
    """The block of xdist worker ``worker`` (``gw3``; default: this process's, from
    ``PYTEST_XDIST_WORKER``; none: not under xdist)."""
    if worker is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return 1
    index = int(worker.removeprefix("gw"))
    if index + 1 >= LOOPBACK_BLOCKS:
        raise ValueError(f"no loopback block left for xdist worker {worker}")
    return index + 1


def _try_claim(block: int, lock_dir: Path) -> int | None:
    """The open lock file of ``block`` if this process could claim it, else None."""
    lock_dir.mkdir(mode=0o1777, parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"block-{block}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, run in {os.getcwd()}\n".encode(), 0)
    return fd


def holder(block: int, lock_dir: Path = LOCK_DIR) -> str:
    """Who last claimed ``block``, as its lock file says ("unknown" if nobody wrote)."""
    try:
        return (lock_dir / f"block-{block}.lock").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def claim_block(preferred: int | None = None, *, lock_dir: Path = LOCK_DIR) -> tuple[int, int]:
    """Claim the first free block from ``preferred`` (default: `worker_block()`) on,
    for as long as this process lives: returns ``(block, fd)``; closing ``fd``
    gives the block back.

    Raises `BlockHeld` when every block from 1 to the last is claimed.
    """
    first = worker_block() if preferred is None else preferred
    for block in [*range(first, LOOPBACK_BLOCKS), *range(1, first)]:
        fd = _try_claim(block, lock_dir)
        if fd is not None:
            return block, fd
    raise BlockHeld(
        f"every loopback block 1-{LOOPBACK_BLOCKS - 1} is claimed by other test runs ({lock_dir})"
    )


def claim_default_block(*, lock_dir: Path = LOCK_DIR, wait: float = 0.0) -> int:
    """Claim block 0 (the product's default addresses) for this process, waiting
    up to ``wait`` seconds for another holder to let go, or raise `BlockHeld`
    naming the run that holds it. Returns the lock's fd."""
    deadline = time.monotonic() + wait
    fd = _try_claim(0, lock_dir)
    while fd is None and time.monotonic() < deadline:
        time.sleep(0.5)
        fd = _try_claim(0, lock_dir)
    if fd is None:
        raise BlockHeld(
            f"the default loopback addresses (127.0.0.N, block 0) are in use by another test run"
            f" ({holder(0, lock_dir)}); run these tests after it ends"
        )
    return fd


#: This process's block, claimed for its whole life.
BLOCK, _BLOCK_FD = claim_block()
#: A first node's address in it (127.BLOCK.1.1).
FIRST = first_node_address(BLOCK)


def fleet_hosts(count: int) -> list[str]:
    """The addresses of a fleet of ``count`` machines in this process's block."""
    return loopback_addresses(count, block=BLOCK)
