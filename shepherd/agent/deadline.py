"""A deadline on a whole HTTP exchange, for ``http.client``.

``http.client``'s timeout bounds each socket operation, not an exchange: a
server that sends its answer a byte at a time, each byte within the
timeout, holds its caller for as long as it likes. On a connection made by
`connection`, `start_exchange` sets a deadline that every step of the next
exchange keeps: the TCP connect, the TLS handshake and the request's send
each get what remains of it as their timeout, and so does each read of the
answer (status line, headers, body); a step that finds it passed raises
``TimeoutError`` (an ``OSError``, as a socket timeout is).
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
from typing import Any


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``); TimeoutError if none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the exchange with the server did not complete in time")
    return left


class _Reader(io.RawIOBase):
    """The answer's bytes from ``sock``, each read within what remains of the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(remaining(self._deadline))
        return self._sock.recv_into(buffer)


class _Socket:
    """What an ``HTTPResponse`` reads from: only ``makefile`` is asked of it.

    Closing the reader leaves the socket open, as ``socket.makefile``'s does
    (the connection may be kept for the next exchange).
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Reader(self._sock, self._deadline))


class _Response(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(_Socket(sock, deadline), *args, **kwargs)  # type: ignore[arg-type]


class _HTTP(http.client.HTTPConnection):
    deadline = float("inf")

    def response_class(self, sock: socket.socket, *args: Any, **kwargs: Any) -> _Response:  # type: ignore[override]
        return _Response(sock, *args, deadline=self.deadline, **kwargs)

    def connect(self) -> None:
        self.timeout = remaining(self.deadline)
        super().connect()


class _HTTPS(_HTTP):
    default_port = http.client.HTTPS_PORT

    def __init__(self, host: str, port: int, context: ssl.SSLContext) -> None:
        super().__init__(host, port)
        self._tls = context

    def connect(self) -> None:
        super().connect()  # TCP, within what remains
        assert self.sock is not None
        self.sock.settimeout(remaining(self.deadline))
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host)


def connection(host: str, port: int, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    """A connection to ``host``:``port`` (TLS with ``context`` if given, else
    plain), not connected yet; every exchange on it must begin with
    `start_exchange`."""
    if context is not None:
        return _HTTPS(host, port, context)
    return _HTTP(host, port)


def start_exchange(conn: http.client.HTTPConnection, timeout: float) -> None:
    """The next exchange on ``conn`` (a `connection`) must complete within
    ``timeout`` seconds from now."""
    assert isinstance(conn, _HTTP)
    conn.deadline = time.monotonic() + timeout
    if conn.sock is not None:  # kept from an earlier exchange
        conn.sock.settimeout(timeout)
