"""A lean HTTP/1.1 client for POST requests with JSON bodies to one UNIX socket.

The etcd client (:mod:`.client`) makes all its calls through here, not
through httpx, which costs several times the CPU per call and per opened
watch (``python -m bench.consensus_start`` compares them). Every node
process does all its work in one Trio thread, and the control plane's
critical paths (granting ConsensusMember: some 40 etcd calls on two nodes,
and a new voter opening half a dozen watches and keep-alives at once,
while a new etcd starts on the same cores) were bound by that thread's CPU.

Unary calls (:meth:`UnixHTTP.post`) read the whole answer; streams
(:meth:`UnixHTTP.open_stream`: watches, lease keep-alives) are read line
by line as etcd writes them, each on a connection of its own.

What it speaks is only what etcd's gateway (Go's ``net/http``) answers to
``POST`` with a JSON body: a status line, headers, and a body framed by
``Content-Length``, by ``Transfer-Encoding: chunked`` (Go chunks bodies
over 2 KiB), or by the end of the connection. Connections are kept alive
and reused (one request at a time each); an idle one the server has closed
(etcd restarted) is noticed before reuse and dropped.

Errors: every failure to get an answer (no socket, refused, dropped,
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
from typing import Literal

import trio

from metropolis.errors import ConsensusError

__all__ = ["ResponseStream", "TransportClosed", "TransportError", "UnixHTTP"]

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
        status, headers, keep = await self.read_head()
        framing = _framing(status, headers)
        if framing == "chunked":
            body = await self._chunked()
        elif isinstance(framing, int):
            body = await self._exactly(framing)
        else:
            body = await self._until_eof()
            keep = False
        return status, body, keep

    async def read_head(self) -> tuple[int, dict[str, str], bool]:
        """(status, headers by lower-case name, whether the connection may be reused)."""
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
        return status, headers, keep

    async def _chunked(self) -> bytes:
        body = bytearray()
        while (chunk := await self.next_chunk()) is not None:
            body += chunk
        return bytes(body)

    async def next_chunk(self) -> bytes | None:
        """The next chunk of a chunked body; None after the last (trailers read)."""
        size_line = (await self._line()).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise _Malformed(f"bad chunk size {size_line[:40]!r}") from None
        if size == 0:
            while await self._line():  # trailers, up to the empty line
                pass
            return None
        chunk = await self._exactly(size)
        if await self._exactly(2) != b"\r\n":
            raise _Malformed("chunk not followed by CRLF")
        return chunk

    async def some(self) -> bytes:
        """What has arrived (at least a byte), or b"" at the end of the connection."""
        if not self.buffer:
            data = await self.stream.receive_some(_CHUNK)
            if not data:
                return b""
            self.buffer += data
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    async def _until_eof(self) -> bytes:
        while True:
            data = await self.stream.receive_some(_CHUNK)
            if not data:
                body = bytes(self.buffer)
                self.buffer.clear()
                return body
            self.buffer += data


def _framing(status: int, headers: dict[str, str]) -> int | Literal["chunked", "eof"]:
    """How a body is framed: chunked, its length, or until the end of the connection."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    if (length := headers.get("content-length")) is not None:
        if not length.isdigit():
            raise _Malformed(f"bad Content-Length {length[:40]!r}")
        return int(length)
    if status in (204, 304) or 100 <= status < 200:
        return 0
    return "eof"


class ResponseStream:
    """A streamed answer, read line by line as it arrives, on a connection of its own.

    Made by :meth:`UnixHTTP.open_stream`; :meth:`close` it when done (the
    connection is never reused: a stream is read until it is abandoned).
    """

    def __init__(
        self, pool: UnixHTTP, connection: _Connection, status: int, headers: dict[str, str]
    ) -> None:
        self.status = status
        self._pool = pool
        self._connection = connection
        self._framing = _framing(status, headers)
        self._left = self._framing if isinstance(self._framing, int) else 0
        self._lines = bytearray()
        self._ended = False

    async def line(self) -> bytes | None:
        """The next line of the body (without its newline); None once the body ended.

        Waits as long as it takes (cancel to stop waiting). Raises
        :class:`TransportError` if the connection breaks or the framing is
        malformed, :class:`TransportClosed` if the pool was closed.
        """
        try:
            while (end := self._lines.find(b"\n")) < 0:
                if not await self._more():
                    rest = bytes(self._lines)
                    self._lines.clear()
                    return rest or None
        except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise self._pool._error(e) from e
        except _Malformed as e:
            raise TransportError(f"malformed stream from {self._pool.socket_path}: {e}") from e
        line = bytes(self._lines[:end])
        del self._lines[: end + 1]
        return line

    async def read_all(self) -> bytes:
        """The rest of the body, whole (for an answer that is not a stream: an error)."""
        lines = []
        while (line := await self.line()) is not None:
            lines.append(line)
        return b"\n".join(lines)

    async def _more(self) -> bool:
        """Read more of the body into the line buffer; False at its end."""
        if self._ended:
            return False
        connection = self._connection
        if self._framing == "chunked":
            chunk = await connection.next_chunk()
        elif self._framing == "eof":
            chunk = await connection.some() or None
        elif self._left:
            data = await connection.some()
            if not data:
                raise EOFError("connection closed inside the body")
            # Past the body's end: not ours (nothing should be there).
            chunk, connection.buffer[:0] = data[: self._left], data[self._left :]
            self._left -= len(chunk)
        else:
            chunk = None
        if chunk is None:
            self._ended = True
            return False
        self._lines += chunk
        return True

    def close(self) -> None:
        """Close the connection (synchronous: also from a cancelled ``finally``)."""
        self._pool._busy.discard(self._connection)
        self._connection.close()


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

    async def _checkout(self, *, reuse: bool) -> _Connection:
        """A connection for one call (an idle one if ``reuse``), counted busy.

        :class:`TransportClosed` if the pool is (or gets) closed meanwhile,
        :class:`TransportError` if no connection could be made.
        """
        if self._closed:
            raise TransportClosed("the connection pool is closed")
        try:
            connection = await self._connect(reuse)
        except OSError as e:
            raise self._error(e) from e
        if self._closed:  # closed while connecting
            connection.close()
            raise TransportClosed("the connection pool was closed during the call")
        self._busy.add(connection)
        return connection

    async def _connect(self, reuse: bool) -> _Connection:
        while reuse and self._idle:
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
        connection = await self._checkout(reuse=True)
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

    async def open_stream(
        self, target: str, body: bytes, *, head_timeout: float | None = None
    ) -> ResponseStream:
        """POST ``body`` (JSON) to ``target`` on a new connection; return its answer as a stream.

        Returns once the status line and headers arrived (within
        ``head_timeout`` seconds, if given); the body is then read as it
        comes (:meth:`ResponseStream.line`). Close the stream when done.
        Raises :class:`TransportError` for every failure to get the head.
        """
        request = self._request(target, body, ())
        # A stream holds its connection until abandoned: a new one, never reused.
        connection = await self._checkout(reuse=False)
        answered = False
        try:
            with trio.move_on_after(float("inf") if head_timeout is None else head_timeout):
                await connection.stream.send_all(request)
                status, headers, _ = await connection.read_head()
                answered = True
            if not answered:
                raise TransportError(
                    f"Timeout: no answer from {self.socket_path} within {head_timeout}s"
                )
        except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise self._error(e) from e
        except _Malformed as e:
            raise TransportError(f"malformed answer from {self.socket_path}: {e}") from e
        finally:
            if not answered:
                self._busy.discard(connection)
                connection.close()
        return ResponseStream(self, connection, status, headers)

    def _error(self, e: BaseException) -> TransportError:
        if self._closed:
            return TransportClosed("the connection pool was closed during the call")
        return TransportError(f"{self.socket_path}: {e!r}")
