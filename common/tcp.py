"""Listening TCP sockets for our servers (Trio)."""

from __future__ import annotations

import socket

import trio

__all__ = ["open_listener"]


async def open_listener(
    host: str, port: int, *, backlog: int, reuse_port: bool = False, nodelay: bool = False
) -> trio.SocketListener:
    """A listening TCP socket on ``host``:``port`` (port 0: any free one).

    IPv6's any-address (``::``) also takes IPv4. ``reuse_port`` sets
    SO_REUSEPORT, so that several processes can listen on one port and the
    kernel spreads connections among them; ``nodelay`` turns Nagle's delay
    off for every accepted connection (small requests answered at once).
    Raises OSError if the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
