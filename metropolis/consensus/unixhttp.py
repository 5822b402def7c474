"""A lean HTTP/1.1 client for small POST requests to one UNIX socket.

The etcd client's unary calls (:mod:`.client`) go through here instead of
httpx: measured against etcd's gateway on this machine, one ``status``
call cost 1.2-1.6 ms of CPU through httpx and 0.17 ms here. Every node
process does all its work in one Trio thread, and the control plane's
critical paths (granting ConsensusMember: some 40 etcd calls on two
nodes, while a new etcd starts on the same cores) were bound by that
thread's CPU. Streaming calls (watches, lease keep-alives) still use httpx:
they are few and long-lived.

What it speaks is only what etcd's gateway (Go's ``net/http``) answers to
``POST`` with a JSON body: a status line, headers, and a body framed by
``Content-Length``, by ``Transfer-Encoding: chunked`` (Go chunks bodies
over 2 KiB), or by the end of the connection. Connections are kept alive
and reused (one request at a time each); an idle one the server has closed
(etcd restarted) is noticed before reuse and dropped.

Errors: every failure to get a whole answer (no socket, refused, dropped,
malformed, timed out) raises :class:`TransportError`; :meth:`UnixHTTP.aclose`
closes the pool, and calls after it (or interrupted by it) raise
:class:`TransportClosed`. Cancellation interrupts a call at any point; the
connection it used is then closed, never reused half-read.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from metropolis.errors import ConsensusError

__all__ = ["TransportClosed", "TransportError", "UnixHTTP"]

#: The longest header block accepted: etcd's are a few hundred bytes.
_MAX_HEADER = 64 * 1024
#: Idle connections kept for reuse; more concurrent calls open more, closed after.
_MAX_IDLE = 8
_CHUNK = 65536


class TransportError(ConsensusError):
    """No complete HTTP answer: unreachable, dropped, malformed or too slow."""


class TransportClosed(TransportError):
    """The pool was closed (before or during the call)."""


class _Malformed(ConsensusError):
    """Internal: the server's bytes are not the HTTP/1.1 we speak."""


@dataclass(eq=False)  # identity: kept in a set
class _Connection:
    stream: trio.SocketStream
    buffer: bytearray = field(default_factory=bytearray)

    def close(self) -> None:
        # Synchronous, so that it also works in a cancelled ``finally``;
        # trio wakes any task blocked on the socket (ClosedResourceError).
        self.stream.socket.close()

    def stale(self) -> bool:
        """An idle connection with something to read has been closed by the server."""
        fd = self.stream.socket.fileno()
        if fd < 0:
            return True
        readable, _, _ = select.select([fd], [], [], 0)
        return bool(readable)

    async def _fill(self) -> None:
        data = await self.stream.receive_some(_CHUNK)
        if not data:
            raise EOFError("connection closed by the server")
        self.buffer += data

    async def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEADER:
                raise _Malformed("line too long")
            await self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def _exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._fill()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def read_response(self) -> tuple[int, bytes, bool]:
        """(status, body, whether the connection may be reused)."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > _MAX_HEADER:
                raise _Malformed("header block too long")
            await self._fill()
        head = bytes(self.buffer[:end]).decode("latin-1")
        del self.buffer[: end + 4]
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _Malformed(f"bad status line {status_line[:100]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise _Malformed(f"bad header line {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
        keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            # Never asked for (no Accept-Encoding is sent), so never decoded.
            raise _Malformed(f"unsupported Content-Encoding {encoding[:40]!r}")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._chunked()
        elif (length := headers.get("content-length")) is not None:
            if not length.isdigit():
                raise _Malformed(f"bad Content-Length {length[:40]!r}")
            body = await self._exactly(int(length))
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:
            body = await self._until_eof()
            keep = False
        return status, body, keep

    async def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = (await self._line()).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise _Malformed(f"bad chunk size {size_line[:40]!r}") from None
            if size == 0:
                while await self._line():  # trailers, up to the empty line
                    pass
                return bytes(body)
            body += await self._exactly(size)
            if await self._exactly(2) != b"\r\n":
                raise _Malformed("chunk not followed by CRLF")

    async def _until_eof(self) -> bytes:
        while True:
            data = await self.stream.receive_some(_CHUNK)
            if not data:
                body = bytes(self.buffer)
                self.buffer.clear()
                return body
            self.buffer += data


class UnixHTTP:
    """A pool of keep-alive HTTP/1.1 connections to ``socket_path``; see the module docstring."""

    def __init__(
        self, socket_path: Path, *, timeout: float, connect_timeout: float, host: str = "localhost"
    ) -> None:
        """``timeout`` bounds a whole call; ``connect_timeout`` its connection set-up."""
        self.socket_path = socket_path
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._host = host
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every connection; calls in flight fail with :class:`TransportClosed`."""
        self._closed = True
        for connection in [*self._idle, *self._busy]:
            connection.close()
        self._idle.clear()

    def _request(self, target: str, body: bytes, headers: Sequence[tuple[str, str]]) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
        if "\n" in extra.replace("\r\n", "") or "\r" in extra.replace("\r\n", ""):
            raise ValueError(f"a header holds a line break: {headers!r}")
        head = (
            f"POST {target} HTTP/1.1\r\nHost: {self._host}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("latin-1") + body

    async def _connect(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.stale():
                return connection
            connection.close()
        with trio.move_on_after(self._connect_timeout) as scope:
            stream = await trio.open_unix_socket(str(self.socket_path))
        if scope.cancelled_caught:
            raise TransportError(f"connecting to {self.socket_path} timed out")
        return _Connection(stream)

    async def post(
        self, target: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``target``; return the status and the whole answer body.

        ``headers`` are sent besides Host, Content-Type and Content-Length
        (names and values must not contain CR or LF).

        Never sends a request twice: a reused connection that fails (the
        server closed it after the idle check) fails the call, as a dropped
        one does. Raises :class:`TransportError` for every failure.
        """
        request = self._request(target, body, headers)
        if self._closed:
            raise TransportClosed("the connection pool is closed")
        try:
            connection = await self._connect()
        except OSError as e:
            raise self._error(e) from e
        if self._closed:  # closed while connecting
            connection.close()
            raise TransportClosed("the connection pool was closed during the call")
        self._busy.add(connection)
        keep = False
        try:
            with trio.move_on_after(self._timeout):
                await connection.stream.send_all(request)
                status, answer, keep = await connection.read_response()
                return status, answer
            raise TransportError(
                f"Timeout: no answer from {self.socket_path} within {self._timeout}s"
            )
        except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise self._error(e) from e
        except _Malformed as e:
            raise TransportError(f"malformed answer from {self.socket_path}: {e}") from e
        finally:
            self._busy.discard(connection)
            if keep and not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(connection)
            else:
                connection.close()

    def _error(self, e: BaseException) -> TransportError:
        if self._closed:
            return TransportClosed("the connection pool was closed during the call")
        return TransportError(f"{self.socket_path}: {e!r}")
