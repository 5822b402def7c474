"""Loopback helpers for the embedded servers (PostgreSQL, etcd, sshd) that
the demo, the tests and the benchmarks start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_loopback_port"]

# Ports below the kernel's ephemeral range are never handed out as the
# source port of an outgoing connection. A port picked from the ephemeral
# range (``bind(0)``) is free when it is picked, but any ``connect()`` on the
# host may take it before the server that was meant to listen on it starts;
# with two test workers opening thousands of connections that happened (a
# Patroni member exiting at start because its REST port was taken).
_FLOOR = 20000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_ATTEMPTS = 200


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, chosen at random
    below the kernel's ephemeral range so that no outgoing connection can
    take it before its server binds it.

    The port is released before returning, so another process that picks
    ports may still take it first (two random picks among some ten
    thousand ports); callers that start a server on it must expect that
    rare failure to bind. Falls back to a port the kernel picks when no
    port below the ephemeral range is free.
    """
    low = _FLOOR
    high = _ephemeral_start()
    if high - low >= 1024:
        for _ in range(_ATTEMPTS):
            port = random.randrange(low, high)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        picked: int = s.getsockname()[1]
        return picked
