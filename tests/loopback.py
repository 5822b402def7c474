"""This test process's own block of loopback addresses, for the tests that
put nodes on the nodes' fixed ports.

A node listens on fixed ports (7834, 7835, 7837) at its own address, so
two tests that start nodes on the same addresses at once collide. Each
pytest-xdist worker takes a block (a /16 of 127.0.0.0/8, all loopback on
Linux) of its own (`shepherd.localfleet.loopback_addresses`): worker gwN
block N+1, one process without xdist block 1. The tests of one worker run
one after another, so such a module can run on any worker. Block 0 (the
demo's and the benchmarks' default, 127.0.0.N and 127.0.1.1) is left to
runs of those by hand on the same host.
"""

from __future__ import annotations

import os

from shepherd.localfleet import LOOPBACK_BLOCKS, first_node_address, loopback_addresses

__all__ = ["BLOCK", "FIRST", "fleet_hosts", "worker_block"]


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


#: This process's block.
BLOCK = worker_block()
#: A first node's address in it (127.BLOCK.1.1).
FIRST = first_node_address(BLOCK)


def fleet_hosts(count: int) -> list[str]:
    """The addresses of a fleet of ``count`` machines in this process's block."""
    return loopback_addresses(count, block=BLOCK)
