"""Network devices and namespaces by kernel identity, not by name.

The test runs (and xdist workers) share the host's network slots
(`shepherd.nspawn.network`): a slot one of them frees is claimed by the
next at once, with a bridge, veths and namespaces of the same names. A
test that checks its own are gone compares identities: a link's ifindex
and a namespace's inode are not given again while the host runs.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["link_id", "namespace_id", "namespaces"]


def link_id(name: str) -> int | None:
    """The ifindex of network device ``name``, or None if there is none."""
    try:
        return int(Path(f"/sys/class/net/{name}/ifindex").read_text())
    except FileNotFoundError:
        return None


def namespace_id(name: str) -> int | None:
    """The inode of network namespace ``name`` (``ip netns``), or None."""
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except FileNotFoundError:
        return None


def namespaces(prefix: str) -> dict[str, int]:
    """The named network namespaces whose name starts with ``prefix``, with their inodes."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return {}
    found = {n: namespace_id(n) for n in names if n.startswith(prefix)}
    return {n: i for n, i in found.items() if i is not None}
