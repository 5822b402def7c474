"""Loopback helpers for the embedded servers (PostgreSQL, etcd, sshd) that
the demo, the tests and the benchmarks start."""

from __future__ import annotations

import socket

__all__ = ["free_loopback_port"]


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    The port is released before returning, so another process may take it
    first; callers that start a server on it must expect the (rare) failure
    to bind and start again.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
