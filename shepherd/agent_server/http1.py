"""A lean HTTP/1.1 server on Trio for the agent callback's unary Connect calls.

The parser is this module's own, not h11 (or a server built on it, such
as hypercorn, which served this endpoint first). This endpoint needs a
small part of HTTP/1.1: one method, small bodies, answers whose length is
known, no upgrades and no streaming, and it is the hot path of every
agent's heartbeat, which costs the server little else once sessions
spare the signature check. Under ``bench/heartbeat.py``, h11's general
machinery (its event objects, the state machine it steps several times per
request, the validation of every header it parses and of those of the
answer it writes) added nearly as much server CPU per heartbeat as all of
the heartbeat's path costs with this parser, far more than this project
lets a library cost over its own code; hypercorn's ASGI machinery on top
of h11 cost more still. So the parser stays, and is strict instead:
it takes only what RFC 9112 allows a server to take and refuses the rest
(mostly with a 400), in particular what request smuggling and crashes are
made of.

What it speaks::

    request line   METHOD SP target SP HTTP/1.1 (or HTTP/1.0), target's query
                   ignored; the method a token
    headers        name: value, by lower-case name, the name a token (so no
                   obsolete line folding, no space before the colon); the last
                   of repeated ones wins, but repeated Content-Length must
                   agree and Transfer-Encoding may come once
    body           Content-Length (ASCII digits only, `common.numbers`), or
                   Transfer-Encoding: chunked (trailers ignored), not both;
                   Expect: 100-continue answered before the body is read
    answer         status, Content-Type, Content-Length, body; Connection: close
                   when the connection ends after it
    keep-alive     HTTP/1.1 unless "Connection: close"; HTTP/1.0 only when asked
    pipelining     requests on one connection are answered in order, one at a time

No control character may appear in a head or a chunk line but HTAB and the
CRLF line ends: a bare CR or LF is a line end to some parsers and not to
others, and a proxy in front would read other headers than this server.
Anything else (a malformed head, a head larger than ``Limits.max_head``, a
body larger than ``Limits.max_body``) is answered with a Connect error (see
`shepherd.agent_server.connect`) and the connection closed, since its
remaining bytes cannot be trusted.

No connection's bytes can end the server: an exception out of one
connection that is not the client going away (a bug, then) is logged (a
line at WARNING, the traceback at DEBUG), answered ``internal`` (500) if
no answer is half sent, and that connection closed; the accept loop and
every other connection go on. Cancellation and KeyboardInterrupt propagate.

Limits, so that no client can hold the server:

- a kept-alive connection idle for ``keep_alive_timeout`` is closed;
- a request must arrive whole (head and body) within ``Limits.body_timeout``
  of its first byte, else ``408`` and the connection is closed;
- a TLS handshake must finish within that time too, an answer must be
  taken by the client within ``send_timeout``, else the connection is closed;
- at most ``max_connections`` connections at once; beyond that, new ones
  wait in the kernel's accept queue.

These timeouts are enforced by one watchdog task that looks at every
connection's current deadline once a tick (at most a second, at most a
quarter of the shortest timeout), so each fires up to a tick late.

Cancellation: cancelling `serve_http1` closes the listeners and every
connection (a request being handled is cancelled with it).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from common.backoff import ExponentialBackoff, Retrier
from common.numbers import parse_decimal
from shepherd.agent_server.connect import ConnectError, ConnectUnary, error_answer
from shepherd.errors import ShepherdError

logger = logging.getLogger("shepherd.agent_server.http1")

_REASONS = {
    100: b"Continue",
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    408: b"Request Timeout",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}

_RECEIVE = 65536
_HEX = b"0123456789abcdefABCDEF"
#: Most digits of a Content-Length (a terabyte; any allowed body has fewer).
_LENGTH_DIGITS = 12
#: Control characters other than HTAB, CR and LF: no line of a request
#: head or of chunked framing may hold one (nor a CR or LF outside a CRLF
#: line end, which some parsers take for a line end and others not, so
#: that a proxy in front and this server would read different headers).
_CONTROL = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
#: RFC 9110's token characters: a method, a header name.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: The headers that say where a request's body ends.
_FRAMING = ("content-length", "transfer-encoding")


@dataclass(frozen=True)
class Timeouts:
    """How long a connection may keep the server waiting, seconds."""

    #: Idle between kept-alive requests.
    keep_alive: float = 25.0
    #: For the client to take an answer.
    send: float = 10.0


class _Close(ShepherdError):
    """The connection ends (after an answer, if one is given). Control flow
    inside this module, never raised to a caller; a `ShepherdError` like
    every exception the package defines."""

    def __init__(self, answer: tuple[int, bytes, bytes] | None = None) -> None:
        super().__init__()
        self.answer = answer


def _refuse(exc: ConnectError) -> _Close:
    return _Close(error_answer(exc))


async def open_listener(
    host: str, port: int, *, backlog: int, reuse_port: bool = False
) -> trio.SocketListener:
    """A listening TCP socket on ``host``:``port`` (port 0: any free one).

    ``reuse_port`` sets SO_REUSEPORT, so that several processes can listen
    on one port and the kernel spreads connections among them. Raises
    OSError if the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # Agents write small requests and wait for small answers: no Nagle delay.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError if malformed.

    The port is ASCII digits, 0 to 65535.
    """
    host, sep, text = listen.rpartition(":")
    try:
        if not sep:
            raise ValueError("no port")
        port = parse_decimal(text, max_digits=5, what="port")
        if port > 65535:
            raise ValueError(f"port {port} above 65535")
    except ValueError as exc:
        raise ValueError(f"{listen!r}: want HOST:PORT ({exc})") from None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def url_of(listener: trio.SocketListener, tls: bool) -> str:
    """The URL a listener serves (``http://127.0.0.1:41234``, ``https://[::]:8443``)."""
    host, port = listener.socket.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


async def serve_http1(
    app: ConnectUnary,
    listeners: Sequence[trio.SocketListener],
    *,
    ssl_context: ssl.SSLContext | None = None,
    timeouts: Timeouts = Timeouts(),
    max_connections: int = 10000,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``listeners`` until cancelled (listeners closed then).

    ``rng`` jitters the pauses after an accept() out of resources
    (`ACCEPT_BACKOFF`).
    """
    connections = trio.Semaphore(max_connections)
    server = _Server(app, ssl_context, timeouts)
    rng = rng if rng is not None else random.Random()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.watchdog)
            for listener in listeners:
                retrier = Retrier(ACCEPT_BACKOFF, random.Random(rng.getrandbits(64)))
                nursery.start_soon(
                    accept_loop, listener, connections, server.connection, nursery, retrier
                )
            task_status.started()
    finally:
        for listener in listeners:
            await trio.aclose_forcefully(listener)


# accept() errors that mean "this one connection failed" or "out of
# resources for now": log, pause, go on (as trio.serve_listeners does).
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
#: Pauses between accept() calls that ran out of resources; an accepted
#: connection starts the count over.
ACCEPT_BACKOFF = ExponentialBackoff(0.05, 2.0, jitter=(0.5, 1.0))


async def accept_loop(
    listener: trio.SocketListener,
    connections: trio.Semaphore,
    handler: Callable[[trio.SocketStream, trio.Semaphore], Awaitable[None]],
    nursery: trio.Nursery,
    retrier: Retrier,
) -> None:
    """Accept connections on ``listener`` for ever, each served by
    ``handler(stream, connections)`` in ``nursery``.

    A connection holds one of ``connections`` from before its accept; the
    handler releases it. accept() out of resources (EMFILE, ENFILE, ENOMEM,
    ENOBUFS) is logged and retried after ``retrier``'s next wait; any other
    OSError is raised.
    """
    while True:
        await connections.acquire()
        try:
            stream = await listener.accept()
        except OSError as exc:
            connections.release()
            if exc.errno not in _ACCEPT_CAPACITY:
                raise
            logger.error("accept: %s; pausing", exc)
            await retrier.sleep()
            continue
        except BaseException:
            connections.release()
            raise
        retrier.reset()
        nursery.start_soon(handler, stream, connections)


class _Server:
    def __init__(
        self, app: ConnectUnary, ssl_context: ssl.SSLContext | None, timeouts: Timeouts
    ) -> None:
        self.app = app
        self.ssl_context = ssl_context
        self.timeouts = timeouts
        self.limits = app.limits
        self.connections: set[_Connection] = set()
        #: How often the watchdog looks, seconds: a timeout fires up to this late.
        self.tick = min(
            1.0, self.limits.body_timeout / 4, timeouts.keep_alive / 4, timeouts.send / 4
        )

    async def watchdog(self) -> None:
        """Cancel every connection past its phase's deadline, every `tick` seconds.

        Why not a deadline on each connection's cancel scope: moving a
        scope's deadline costs Trio's deadline bookkeeping, three or four
        times per request, a visible share of a request's CPU in the
        profile; here the hot path only stores a number.
        """
        while True:
            await trio.sleep(self.tick)
            now = trio.current_time()
            for connection in self.connections:
                if connection.deadline < now:
                    connection.scope.cancel()

    async def connection(self, tcp: trio.SocketStream, connections: trio.Semaphore) -> None:
        """Serve one connection until it closes, times out or breaks.

        Raises nothing but cancellation (and KeyboardInterrupt): whatever
        else goes wrong ends this connection only (see the module's docstring).
        """
        stream: trio.abc.Stream = tcp
        connection: _Connection | None = None
        try:
            if self.ssl_context is not None:
                tls = trio.SSLStream(tcp, self.ssl_context, server_side=True)
                stream = tls
                with trio.move_on_after(self.limits.body_timeout) as handshake:
                    await tls.do_handshake()
                if handshake.cancelled_caught:
                    return
            connection = _Connection(
                self, stream, tcp.socket.fileno() if self.ssl_context is None else None
            )
            self.connections.add(connection)
            try:
                await connection.serve()
            finally:
                self.connections.discard(connection)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away (or TLS broke): nothing to answer
        except Exception as exc:
            # A bug, reached by this connection's bytes: it must not take the
            # server (every other connection, the process) down with it.
            logger.warning("connection from %s failed, closed: %r", _peer(tcp), exc)
            logger.debug("connection failure", exc_info=True)
            if connection is not None:
                await connection.internal_error()
        finally:
            connections.release()
            await trio.aclose_forcefully(stream)


def _peer(tcp: trio.SocketStream) -> str:
    try:
        return str(tcp.socket.getpeername()[:2])
    except OSError:
        return "unknown peer"


class _Connection:
    """One connection's state: its stream, unread bytes, its cancel scope,
    and the deadline of its current phase (kept by `_Server.watchdog`).

    A plain TCP connection (``fd`` given, the stream's socket) is read and
    written on its socket directly, waiting through Trio only when the
    socket would block: Trio's socket stream yields to the scheduler after
    every read and write that did not block, two more trips through its
    run loop per request than the wait for the request's bytes and the
    handler's own wait. A request that came without any wait of its
    connection is followed by a checkpoint (`serve`), so that a client
    pipelining requests to a handler that never waits still lets the
    other connections run and cancellation in. TLS goes through the stream.
    """

    def __init__(self, server: _Server, stream: trio.abc.Stream, fd: int | None = None) -> None:
        self.app = server.app
        self.limits = server.limits
        self.timeouts = server.timeouts
        self.stream = stream
        self.fd = fd
        #: Whether the connection waited for its socket since this was last reset.
        self.waited = False
        self.buffer = bytearray()
        self.scope = trio.CancelScope()
        #: When the current phase (idle, reading, answering) must be over (Trio time).
        self.deadline = math.inf
        #: Between a request's first byte and its last: a timeout then is a 408.
        self.reading = False
        #: While an answer is being sent: no other answer can follow it.
        self.sending = False

    async def receive_some(self) -> bytes | bytearray:
        """The next bytes from the client (empty at the end of the stream);
        `trio.BrokenResourceError` if the connection broke."""
        fd = self.fd
        if fd is None:
            return await self.stream.receive_some(_RECEIVE)
        while True:
            try:
                return os.read(fd, _RECEIVE)
            except BlockingIOError:
                self.waited = True
                await trio.lowlevel.wait_readable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(f"receive failed: {exc}") from exc

    async def send_all(self, data: bytes) -> None:
        """All of ``data`` to the client; `trio.BrokenResourceError` if the connection broke."""
        fd = self.fd
        if fd is None:
            await self.stream.send_all(data)
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                self.waited = True
                await trio.lowlevel.wait_writable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(f"send failed: {exc}") from exc

    async def receive(self) -> None:
        """More bytes into the buffer; `_Close` at the end of the stream."""
        data = await self.receive_some()
        if not data:
            raise _Close()
        self.buffer += data

    async def serve(self) -> None:
        buffer = self.buffer
        with self.scope:
            while True:
                self.reading = False
                self.waited = False
                if not buffer:
                    self.deadline = trio.current_time() + self.timeouts.keep_alive
                    data = await self.receive_some()
                    if not data:
                        return  # closed between requests: the normal end
                    buffer += data
                self.reading = True
                self.deadline = trio.current_time() + self.limits.body_timeout
                try:
                    keep_alive = await self.request()
                except _Close as close:
                    if close.answer is not None:
                        self.deadline = trio.current_time() + self.timeouts.send
                        await self.answer(*close.answer, keep_alive=False)
                    return
                if not keep_alive:
                    return
                if self.fd is not None and not self.waited:
                    await trio.lowlevel.checkpoint()  # see the class's docstring
        if self.scope.cancelled_caught and self.reading:
            # In the middle of a request: tell the client why it is cut off.
            with trio.move_on_after(self.timeouts.send):
                exc = ConnectError(
                    "deadline_exceeded",
                    f"request not received within {self.limits.body_timeout:g}s",
                    408,
                )
                await self.answer(*error_answer(exc), keep_alive=False)

    async def request(self) -> bool:
        """Read, handle and answer one request; keep the connection alive?"""
        buffer = self.buffer
        max_head = self.limits.max_head
        end = buffer.find(b"\r\n\r\n")
        while end < 0:
            if len(buffer) > max_head:
                raise _refuse(ConnectError("resource_exhausted", "request head too large", 431))
            searched = max(0, len(buffer) - 3)
            await self.receive()
            end = buffer.find(b"\r\n\r\n", searched)
        if end > max_head:
            raise _refuse(ConnectError("resource_exhausted", "request head too large", 431))
        head = bytes(buffer[:end])
        del buffer[: end + 4]
        method, path, version, headers = _parse_head(head)
        keep_alive = _keep_alive(version, headers.get("connection", ""))
        try:
            handler = self.app.check(method, path, headers)
        except ConnectError as exc:
            raise _refuse(exc) from None
        body = await self.body(headers)
        # The request is in: its handling is not the client's to time out.
        self.reading = False
        self.deadline = math.inf
        status, content_type, answer = await self.app.call(handler, headers, body)
        self.deadline = trio.current_time() + self.timeouts.send
        await self.answer(status, content_type, answer, keep_alive=keep_alive)
        return keep_alive

    async def body(self, headers: dict[str, str]) -> bytes:
        """The request body, at most ``Limits.max_body`` bytes."""
        limit = self.limits.max_body
        too_large = ConnectError("resource_exhausted", f"request body larger than {limit} bytes")
        expect = headers.get("expect", "").lower() == "100-continue"
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            if encoding.lower() != "chunked" or "content-length" in headers:
                raise _refuse(ConnectError("invalid_argument", "unsupported transfer-encoding"))
            if expect:
                await self.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            return await self.chunked(limit, too_large)
        declared = headers.get("content-length")
        try:
            length = (
                0
                if declared is None
                else parse_decimal(declared, max_digits=_LENGTH_DIGITS, what="content-length")
            )
        except ValueError as exc:
            raise _refuse(ConnectError("invalid_argument", str(exc))) from None
        if length > limit:
            raise _refuse(too_large)
        if expect and len(self.buffer) < length:
            await self.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self.buffer) < length:
            await self.receive()
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    async def chunked(self, limit: int, too_large: ConnectError) -> bytes:
        """A chunked body, at most ``limit`` bytes; trailers skipped."""
        buffer = self.buffer
        chunks: list[bytes] = []
        size = 0
        while True:
            size_text = (await self.line()).split(b";", 1)[0].strip(b" \t")
            if not size_text or len(size_text) > 8 or size_text.strip(_HEX):
                raise _refuse(ConnectError("invalid_argument", "malformed chunk size"))
            length = int(size_text, 16)
            if length == 0:
                while await self.line():  # trailers, up to the empty line
                    pass
                return b"".join(chunks)
            size += length
            if size > limit:
                raise _refuse(too_large)
            while len(buffer) < length + 2:
                await self.receive()
            if buffer[length : length + 2] != b"\r\n":
                raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
            chunks.append(bytes(buffer[:length]))
            del buffer[: length + 2]

    async def line(self) -> bytes:
        """One CRLF-terminated line of a chunked body (at most 1 KiB)."""
        buffer = self.buffer
        while (end := buffer.find(b"\r\n")) < 0:
            if len(buffer) > 1024:
                raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
            await self.receive()
        if end > 1024:
            raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
        text = bytes(buffer[:end])
        if not _clean(text):
            raise _refuse(ConnectError("invalid_argument", "control character in chunked body"))
        del buffer[: end + 2]
        return text

    async def answer(
        self, status: int, content_type: bytes, body: bytes, *, keep_alive: bool
    ) -> None:
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, b"Unknown"),
            content_type,
            len(body),
            b"" if keep_alive else b"Connection: close\r\n",
        )
        self.sending = True
        await self.send_all(head + body)
        self.sending = False

    async def internal_error(self) -> None:
        """Answer ``internal`` (500) and close, unless an answer is half sent.

        Within the send timeout; raises nothing but cancellation.
        """
        if self.sending:
            return
        with trio.move_on_after(self.timeouts.send):
            try:
                exc = ConnectError("internal", "internal error")
                await self.answer(*error_answer(exc), keep_alive=False)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _clean(text: bytes) -> bool:
    """No control character in ``text`` but HTAB and CRLF pairs (counted in C,
    cheaper than a regular expression over the head)."""
    crs = text.count(b"\r")
    return (
        len(text.translate(None, _CONTROL)) == len(text)
        and crs == text.count(b"\n")
        and crs == text.count(b"\r\n")
    )


def _parse_head(head: bytes) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, version, headers by lower-case name) of a request head.

    `_Close` with a 400 if it is not well-formed (see the module's
    docstring), a 505 for a version other than 1.0 and 1.1.
    """
    if not _clean(head):
        raise _refuse(ConnectError("invalid_argument", "control character in request head"))
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise _refuse(ConnectError("invalid_argument", "malformed request line"))
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _refuse(ConnectError("unimplemented", "HTTP/1.1 only", 505))
    if not method or method.translate(None, _TOKEN) or not target:
        raise _refuse(ConnectError("invalid_argument", "malformed request line"))
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        # A name is a token: no space before the colon, no obsolete line folding.
        if not colon or not name or name.translate(None, _TOKEN):
            raise _refuse(ConnectError("invalid_argument", "malformed header line"))
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        # RFC 9112 6.3: with a proxy in front that took the other one, the
        # two would disagree on where the body ends, and a request could be
        # smuggled in it. Repeated Content-Length must agree; a second
        # Transfer-Encoding would be a second coding.
        if (
            key in headers
            and key in _FRAMING
            and (key == "transfer-encoding" or headers[key] != text)
        ):
            raise _refuse(ConnectError("invalid_argument", f"conflicting {key} headers"))
        headers[key] = text
    path = target.split(b"?", 1)[0].decode("latin-1")
    return method.decode("latin-1"), path, version, headers


def _keep_alive(version: bytes, connection: str) -> bool:
    tokens = {t.strip() for t in connection.lower().split(",")} if connection else set()
    if version == b"HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens
