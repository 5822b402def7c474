"""A lean HTTP/1.1 server on Trio for the agent callback's unary Connect calls.

Requests are parsed by llhttp (Node.js's HTTP/1.1 parser, through
``httptools``, as uvicorn parses them), a strict parser made against
request smuggling; this module decides, on llhttp's callbacks, what a
parser cannot decide for this endpoint. Not h11 (or a server built on it,
such as hypercorn, which served this endpoint first): under
``bench/heartbeat.py`` its general machinery (event objects, a state
machine stepped several times per request, validation of every header of
the request and of the answer) cost nearly as much server CPU per
heartbeat as all the rest of the heartbeat's path. Neither the
hand-written parser that replaced h11: llhttp parses a heartbeat in less
than half its time (``bench.heartbeat`` keeps it as the baseline,
`bench.http1_handwritten`), and refuses more of what smuggling is made of.

What it speaks::

    request line   METHOD SP target SP HTTP/1.1 (or HTTP/1.0), target's query
                   ignored; a method llhttp knows (others: 400)
    headers        name: value, by lower-case name, trailing whitespace
                   stripped; the last of repeated ones wins, but
                   Content-Length and Transfer-Encoding may come once each
    body           Content-Length (ASCII digits only, `common.numbers`), no
                   Transfer-Encoding (see "Chunked bodies" below);
                   Expect: 100-continue answered before the body is read
    answer         status, Content-Type, Content-Length, body; Connection: close
                   when the connection ends after it
    keep-alive     HTTP/1.1 unless "Connection: close"; HTTP/1.0 only when asked
    pipelining     requests on one connection are answered in order, one at a time

What llhttp refuses (a 400, and the connection closed, since its remaining
bytes cannot be trusted): a control character in a head but HTAB (NUL, a
bare CR or LF: some parsers take those for line ends and others not, so
that a proxy in front would read other headers than this server), obsolete
line folding, a header name that is not a token, a Content-Length that is
not digits, overflows 64 bits or comes twice (even with one value),
Transfer-Encoding with Content-Length or twice, an unknown method or
malformed request line, data after a request that closes the connection
(`tests/shepherd/test_llhttp_edges.py` pins these). What this module
refuses the same way, on llhttp's callbacks: a version other than 1.0 and
1.1 (505), a chunked body (411) and any other Transfer-Encoding (400), a
Content-Length of more than 12 digits, an upgrade; a head of more than
``Limits.max_head`` bytes or ``Limits.max_headers`` header lines (431) and
a body larger than ``Limits.max_body`` (429, before it is read). Other
refusals are the Connect layer's (see `shepherd.agent_server.connect`),
from the head alone, before the body is read.

Chunked bodies: refused with ``411 Length Required`` (RFC 9112 section 6.3
lets a server refuse a body without a Content-Length), before any of the
body is read. Agents are this server's only clients, and the agent
(`shepherd.agent.heartbeat`, http.client given the body as bytes) always
sends a Content-Length; so does the load generator of the benchmarks. The
Connect protocol leaves framing to HTTP and does not ask for chunked
requests. Refusing them means every body's size is known, and judged
against ``Limits.max_body``, from the head alone; no chunk framing or
trailers are parsed, two of the forms request smuggling is made of.

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

import collections
import errno
import logging
import math
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httptools
import trio

from common.backoff import ExponentialBackoff, Retrier
from common.numbers import parse_decimal
from shepherd.agent_server.connect import ConnectError, ConnectUnary, Handler, error_answer
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
    411: b"Length Required",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}

_RECEIVE = 65536
#: Most digits of a Content-Length (a terabyte; any allowed body has fewer).
_LENGTH_DIGITS = 12


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
    """One connection's state: its stream, its llhttp parser and the request
    being parsed, the requests parsed and not yet answered, its cancel
    scope, and the deadline of its current phase (kept by `_Server.watchdog`).

    The parser's callbacks (the ``on_*`` methods) run inside
    ``feed_data``, which cannot wait: they judge and collect, and `serve`
    answers the requests they completed, in order. A callback's refusal
    (or a bug) stops the parser; `serve` then answers the requests
    completed before it and ends the connection with the refusal (or
    the 500), so that pipelined answers keep their order.

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
        self.scope = trio.CancelScope()
        #: When the current phase (idle, reading, answering) must be over (Trio time).
        self.deadline = math.inf
        #: Between a request's first byte and its last: a timeout then is a 408.
        self.reading = False
        #: While an answer is being sent: no other answer can follow it.
        self.sending = False
        self.parser = httptools.HttpRequestParser(self)
        #: Parsed requests not yet answered, oldest first.
        self.ready: collections.deque[_Request] = collections.deque()
        #: What ended the parsing (a refusal, or a bug's exception); after
        #: the requests in `ready`, it ends the connection.
        self.failure: Exception | None = None
        # The request being parsed.
        self.in_message = False
        self.in_head = False
        self.url = b""
        #: Its header lines as llhttp gave them (then its trailers).
        self.raw: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        #: Bytes fed while it was incomplete, after the read it began in
        #: (-1: it began in the read being fed).
        self.fed = 0
        #: Bytes in the read being fed.
        self.feeding = 0
        #: Most bytes a request may span: its head, its body and one read more.
        self.max_request = self.limits.max_head + self.limits.max_body + _RECEIVE
        self.handler: Handler | None = None
        self.keep_alive = True
        self.body_parts: list[bytes] = []
        self.body_size = 0
        #: A "100 Continue" is owed before this request's body is read.
        self.continue_due = False

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

    async def serve(self) -> None:
        ready = self.ready
        with self.scope:
            while True:
                while ready:
                    request = ready.popleft()
                    self.reading = False
                    self.deadline = math.inf  # handling is not the client's to time out
                    status, content_type, answer = await self.app.call(
                        request.handler, request.headers, request.body
                    )
                    self.deadline = trio.current_time() + self.timeouts.send
                    await self.answer(status, content_type, answer, keep_alive=request.keep_alive)
                    if not request.keep_alive:
                        return
                    if self.fd is not None and not self.waited:
                        # Its bytes were read without a wait: see the class's docstring.
                        await trio.lowlevel.checkpoint()
                    self.waited = False
                    if self.in_message:  # the next one's bytes came meanwhile: its time starts
                        self.reading = True
                        self.deadline = trio.current_time() + self.limits.body_timeout
                failure = self.failure
                if failure is not None:
                    if not isinstance(failure, _Close):
                        raise failure  # a bug: see `_Server.connection`
                    if failure.answer is not None:
                        self.deadline = trio.current_time() + self.timeouts.send
                        await self.answer(*failure.answer, keep_alive=False)
                    return
                if not self.in_message:
                    self.reading = False
                    self.deadline = trio.current_time() + self.timeouts.keep_alive
                elif not self.reading:  # its first bytes came in the last read
                    self.reading = True
                    self.deadline = trio.current_time() + self.limits.body_timeout
                if self.continue_due:
                    self.continue_due = False
                    await self.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                data = await self.receive_some()
                if not data:
                    return  # closed: between requests the normal end, else nothing to answer
                self.feed(data)
        if self.scope.cancelled_caught and self.reading:
            # In the middle of a request: tell the client why it is cut off.
            with trio.move_on_after(self.timeouts.send):
                exc = ConnectError(
                    "deadline_exceeded",
                    f"request not received within {self.limits.body_timeout:g}s",
                    408,
                )
                await self.answer(*error_answer(exc), keep_alive=False)

    def feed(self, data: bytes | bytearray) -> None:
        """Parse ``data``: complete requests go to `ready`, a refusal or a
        bug's exception to `failure` (which ends the parsing)."""
        self.feeding = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # One of our callbacks raised (a refusal, or a bug): that is the failure.
            cause = exc.__context__
            self.failure = cause if isinstance(cause, Exception) else exc
            return
        except httptools.HttpParserUpgrade:
            self.failure = _refuse(ConnectError("invalid_argument", "upgrades are not supported"))
            return
        except httptools.HttpParserError as exc:
            self.failure = _refuse(ConnectError("invalid_argument", f"malformed request: {exc}"))
            return
        if self.in_message:
            # What llhttp and httptools hold of an incomplete request (a
            # header's value so far, trailers) is bounded by counting the
            # reads it spans: all of each read after the first is its bytes.
            if self.fed < 0:
                self.fed = 0  # it began in this read
            else:
                self.fed += len(data)
                if self.in_head and self.fed > self.limits.max_head:
                    self.failure = _head_too_large()
                elif self.fed > self.max_request:
                    self.failure = _refuse(_body_too_large(self.limits.max_body))

    # --- llhttp's callbacks (they run inside `feed`) ---

    def on_message_begin(self) -> None:
        self.in_message = self.in_head = True
        self.url = b""
        self.raw = []
        self.fed = -1
        self.body_parts = []
        self.body_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_head:
            raise _head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        # Collected only: judged once the head is complete (its size is
        # bounded by `feed` meanwhile). No trailers come here: a chunked
        # body is refused at the end of its head.
        self.raw.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        raw = self.raw
        self.raw = []
        limits = self.limits
        if len(raw) > limits.max_headers or (
            # A head that began in this read, no longer than the limit, is within it.
            (self.fed >= 0 or self.feeding > limits.max_head)
            and _REQUEST_LINE + len(self.url) + sum([len(n) + len(v) + 4 for n, v in raw])
            > limits.max_head
        ):
            raise _head_too_large()
        parser = self.parser
        if parser.get_http_version() not in _VERSIONS:
            raise _refuse(ConnectError("unimplemented", "HTTP/1.1 only", 505))
        if parser.should_upgrade():
            raise _refuse(ConnectError("invalid_argument", "upgrades are not supported"))
        # The last of repeated headers wins (llhttp refused repeated framing
        # headers); llhttp strips the whitespace before a value, not after it.
        headers = {n.decode("latin-1").lower(): v.decode("latin-1").rstrip(" \t") for n, v in raw}
        self.headers = headers
        limit = limits.max_body
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            # llhttp refused it beside a Content-Length, and twice. Chunked
            # bodies: see the module's docstring.
            if encoding.lower() == "chunked":
                raise _refuse(
                    ConnectError(
                        "invalid_argument",
                        "a chunked body is not accepted: send a Content-Length",
                        411,
                    )
                )
            raise _refuse(ConnectError("invalid_argument", "unsupported transfer-encoding"))
        text = headers.get("content-length")
        try:
            declared = (
                0
                if text is None
                else parse_decimal(text, max_digits=_LENGTH_DIGITS, what="content-length")
            )
        except ValueError as exc:
            raise _refuse(ConnectError("invalid_argument", str(exc))) from None
        if declared > limit:
            raise _refuse(_body_too_large(limit))
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        try:
            self.handler = self.app.check(parser.get_method().decode("latin-1"), path, headers)
        except ConnectError as exc:
            raise _refuse(exc) from None
        self.keep_alive = parser.should_keep_alive()
        if declared != 0 and "expect" in headers:
            self.continue_due = headers["expect"].lower() == "100-continue"

    def on_body(self, data: bytes) -> None:
        self.body_size += len(data)
        if self.body_size > self.limits.max_body:
            raise _refuse(_body_too_large(self.limits.max_body))
        self.body_parts.append(data)

    def on_message_complete(self) -> None:
        self.in_message = False
        self.continue_due = False  # the body is here already
        parts = self.body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        assert self.handler is not None  # on_headers_complete set it, or refused
        self.ready.append(_Request(self.handler, self.headers, body, self.keep_alive))
        self.handler = None

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


@dataclass(frozen=True, slots=True)
class _Request:
    """A parsed request, judged by its head, waiting for its turn."""

    handler: Handler
    #: By lower-case name.
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


#: What a request line adds to its target in the head's size ("POST ",
#: " HTTP/1.1", CRLF), and the empty line that ends the head.
_REQUEST_LINE = 18
_VERSIONS = ("1.1", "1.0")


def _head_too_large() -> _Close:
    return _refuse(ConnectError("resource_exhausted", "request head too large", 431))


def _body_too_large(limit: int) -> ConnectError:
    return ConnectError("resource_exhausted", f"request body larger than {limit} bytes")
