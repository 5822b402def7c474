"""gRPC calls on one HTTP/2 connection to one server, over any Trio byte stream.

::

    async with Channel(partial(trio.open_unix_socket, path), "etcd") as channel:
        answer = await channel.unary("/etcdserverpb.KV/Range", request, RangeResponse)
        async with channel.bidi("/etcdserverpb.Watch/Watch", WatchResponse) as call:
            await call.send(WatchRequest(...))
            async for response in call:
                ...

Two clients are built from these pieces: :class:`Channel`, which talks to
one server over a stream its ``connect`` function opens (cleartext HTTP/2
with prior knowledge on a UNIX socket, as the node's own etcd serves it),
and the curator client (:mod:`metropolis.rpc.client`), which adds TLS,
server keys and failover between curators and builds its calls from the
same :class:`StreamCall` and :func:`start_connection`.

**Connections.** A :class:`Channel` connects on its first call and keeps
the connection for every later call, multiplexed. When the connection
breaks, calls on it fail with UNAVAILABLE and the next call connects anew.
A call that provably never reached the server (the server had said GOAWAY
before seeing it) is tried once more, on a new connection.

**Errors.** Every failure is :class:`~metropolis.rpc.status.RPCError`:
the server's status, or UNAVAILABLE when the server could not be reached
or the connection broke during the call (:class:`ConnectionLost`, which
tells it from an UNAVAILABLE the server sent); :class:`ChannelClosed` (a
:class:`ConnectionLost`) once the channel was closed.

**Cancellation and deadlines.** The caller's Trio deadline is sent as
``grpc-timeout``. Cancelling a call, or leaving a ``stream``/``bidi`` block
early, resets its HTTP/2 stream (RST_STREAM CANCEL); other calls go on.
Leaving the channel's block closes the connection (GOAWAY).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Generic, Self, TypeVar, cast

import betterproto2
import h2.errors
import trio

from common.numbers import parse_decimal
from common.protobuf import parse_checked
from metropolis.errors import MetropolisError
from metropolis.rpc import wire
from metropolis.rpc.method import Message
from metropolis.rpc.pipe import Pipe
from metropolis.rpc.status import (
    LEADER_ADDRESS_HEADER,
    LEADER_NODE_HEADER,
    LeaderHint,
    RPCError,
    Status,
)
from metropolis.rpc.transport import (
    Closed,
    Connection,
    Data,
    End,
    Headers,
    Reset,
    StreamGone,
    peer_refused_certificate,
)

__all__ = [
    "Channel",
    "ChannelClosed",
    "ConnectionLost",
    "NotTaken",
    "StreamCall",
    "call_metadata",
    "raise_if_refused",
    "request_payload",
    "single_response",
    "start_connection",
]

_log = logging.getLogger("metropolis.rpc.channel")

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


class NotTaken(MetropolisError):
    """The call did not run on this server; another (or a new connection) may take it.

    ``again``: the server closed the connection cleanly (GOAWAY) before
    taking the call, as a server closing an idle connection does; a new
    connection to it may take the call. ``leader``: the server is not the
    leader and named it.
    """

    def __init__(
        self, error: RPCError, leader: LeaderHint | None = None, *, again: bool = False
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.leader = leader
        self.again = again


class ConnectionLost(RPCError):
    """UNAVAILABLE from the transport: the server could not be reached, or the
    connection closed or broke during the call (not a status the server sent)."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.UNAVAILABLE, message)


class ChannelClosed(ConnectionLost):
    """The channel was closed (before or during the call); no call through it can succeed."""

    def __init__(self, message: str = "channel closed") -> None:
        super().__init__(message)


def raise_if_refused(failure: BaseException | None) -> None:
    """Raise UNAUTHENTICATED if ``failure`` is the server's TLS refusing our certificate."""
    reason = peer_refused_certificate(failure)
    if reason is not None:
        raise RPCError(Status.UNAUTHENTICATED, f"server refused our certificate: {reason}")


def request_payload(request: Message | None) -> bytes | None:
    """The request's bytes (None for a client stream's empty opening); bounded in size."""
    payload = None if request is None else bytes(request)
    if payload is not None and len(payload) > wire.MAX_MESSAGE:
        raise RPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request of {len(payload)} bytes exceeds {wire.MAX_MESSAGE}",
        )
    return payload


def call_metadata(metadata: Mapping[str, str] | None, *, deadline: bool = True) -> dict[str, str]:
    """The call's metadata, with the caller's Trio deadline as ``grpc-timeout``
    (unless ``deadline`` is False).

    Keys are sent in lower case, values as UTF-8. Raises INTERNAL for
    metadata that is not gRPC's or that HTTP/2 cannot carry (a key of other
    characters than letters, digits, ``-``, ``_`` and ``.``, one that HTTP/2
    or the request itself reserves, a value with NUL, CR or LF or that
    starts or ends with a space or tab): the transport sends headers as
    they are. A value outside ASCII is sent (HTTP/2 carries it; gRPC's
    ASCII-Value rule is the server's to enforce, and hostile-input tests
    send such values to see the server refuse them).
    """
    # Lower case, as gRPC's runtimes send every key (HTTP/2 requires it).
    extra = {key.lower(): value for key, value in (metadata or {}).items()}
    for key, value in extra.items():
        if (
            not _METADATA_KEY.fullmatch(key)
            or key in _RESERVED_KEYS
            or not _METADATA_VALUE.fullmatch(value)
        ):
            raise RPCError(Status.INTERNAL, f"metadata {key!r}: {value!r} cannot be sent")
    if deadline:
        effective = trio.current_effective_deadline()
        if effective != float("inf") and "grpc-timeout" not in extra:
            extra["grpc-timeout"] = wire.encode_timeout(effective - trio.current_time())
    return extra


#: gRPC's metadata keys (PROTOCOL-HTTP2.md: Header-Name), and the values
#: HTTP/2 carries (RFC 9113 8.2.1; the server's check, transport._VALUE).
_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_METADATA_VALUE = re.compile(r"(?:[^\x00\n\r \t](?:[^\x00\n\r]*[^\x00\n\r \t])?)?")
#: Keys the request carries itself, or that HTTP/2 forbids (RFC 9113 8.2.2).
_RESERVED_KEYS = frozenset(
    {"content-type", "te", "user-agent", "host"}
    | {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "upgrade"}
)


async def start_connection(
    nursery: trio.Nursery, stream: trio.abc.Stream | Pipe, keepalive: tuple[float, float] | None
) -> Connection:
    """Run a client HTTP/2 connection on ``stream`` (its reader in ``nursery``).

    ``stream``: a :class:`~metropolis.rpc.pipe.Pipe` (TLS handshaken), or a
    byte stream that carries HTTP/2 as it is.

    Returns once the server's SETTINGS arrived. Raises
    :class:`~metropolis.rpc.transport.StreamGone` if the connection closed
    during set-up (UNAUTHENTICATED if that was a TLS refusal of our
    certificate). ``keepalive`` is (interval, timeout) of PINGs, or None.
    """
    pipe = stream if isinstance(stream, Pipe) else Pipe(stream)
    conn = Connection(pipe, client_side=True)
    nursery.start_soon(conn.run)
    try:
        # In TLS 1.3 the server judges our certificate only after our
        # handshake is done: its refusal is an alert on the first read.
        # Wait for its SETTINGS (or that alert) before using the
        # connection, so a refusal is reported as one, not as a write
        # that happened to find the socket closed.
        await conn.start()
        await conn.settled.wait()
    except BaseException:
        await conn.aclose()
        raise
    if conn.closed:
        raise_if_refused(conn.read_failure)
        raise StreamGone(f"connection closed during setup: {conn.failure!r}")
    if keepalive is not None:
        nursery.start_soon(conn.keepalive, *keepalive)
    return conn


async def single_response(call: StreamCall[Resp]) -> Resp:
    """The one response of a unary call; INTERNAL if there are none or more. Closes ``call``."""
    try:
        response = await call.__anext__()
        try:
            await call.__anext__()
        except StopAsyncIteration:
            return response
        raise RPCError(Status.INTERNAL, "unary method sent more than one response")
    except StopAsyncIteration:
        raise RPCError(Status.INTERNAL, "unary method sent no response") from None
    finally:
        await call.aclose()


class StreamCall(Generic[Resp]):
    """One call in flight: iterate it for responses, ``send`` requests on a client stream.

    ``authority`` and ``scheme`` go into the request's pseudo-headers;
    ``on_broken`` is told when a call finds the connection broken.
    """

    def __init__(
        self,
        conn: Connection,
        response_type: type[Resp],
        authority: str,
        *,
        scheme: str = "https",
        on_broken: Callable[[Connection], None] = lambda _conn: None,
    ) -> None:
        self._conn = conn
        self._type = response_type
        self._authority = authority
        self._scheme = scheme
        self._on_broken = on_broken
        self._sid: int | None = None
        self._decoder = wire.MessageDecoder()
        self._pending: list[bytes] = []
        self._finished = False
        self._headers_seen = False
        #: The server refused the stream unprocessed (RST_STREAM REFUSED_STREAM).
        self._refused = False
        #: The server sent a status (as opposed to the connection failing).
        self._answered = False
        #: The server said GOAWAY before this stream, and closed: it never saw it.
        self._unseen = False
        #: done_sending() was called (client-streaming calls).
        self._sent_all = False

    async def open(self, path: str, payload: bytes | None, metadata: Mapping[str, str]) -> None:
        """Send the request headers (and ``payload``, ending the request, unless None).

        Raises :class:`NotTaken` if the request could not leave whole.
        """
        headers = [
            (":method", "POST"),
            (":scheme", self._scheme),
            (":path", path),
            (":authority", self._authority),
            ("content-type", wire.CONTENT_TYPE),
            ("te", "trailers"),
            ("user-agent", "metropolis-rpc/1"),
            *metadata.items(),
        ]
        try:
            body = None if payload is None else wire.frame(payload)
            self._sid = await self._conn.open_stream(headers, body)
        except StreamGone as e:
            # The request did not leave whole (a write failed), so the server
            # did not run it: safe to try again. But in TLS 1.3 a refused
            # client certificate shows only after the handshake, as a closed
            # connection: that is no reason to try elsewhere.
            raise_if_refused(self._conn.read_failure)
            clean = self._conn.failure is None
            raise NotTaken(ConnectionLost("connection closing"), again=clean) from e

    async def wait_headers(self) -> None:
        """Wait for the response headers.

        A not-leader answer or a refused stream raises :class:`NotTaken`.
        """
        while not self._headers_seen and not self._finished:
            try:
                await self._step()
            except RPCError as e:
                # UNAVAILABLE from the server itself (not a lost connection)
                # before any response: it did not take the call (not the
                # leader, or no leader known yet). Another server may.
                if e.code is Status.UNAVAILABLE and (self._answered or self._refused):
                    raise NotTaken(e, e.leader) from e
                if e.code is Status.UNAVAILABLE and self._unseen:
                    raise NotTaken(e, again=True) from e
                raise

    async def _fail_transport(self) -> None:
        self._finished = True
        failure = self._conn.read_failure
        last = self._conn.goaway_last_stream
        if last is not None and self._sid is not None and self._sid > last:
            # The server said GOAWAY before it saw this stream (RFC 9113
            # 6.8: it did not run): it may take it on a new connection.
            self._unseen = True
            raise ConnectionLost(f"{self._authority} closed the connection")
        self._on_broken(self._conn)
        raise_if_refused(failure)
        raise ConnectionLost(f"connection to {self._authority} lost")

    async def _step(self) -> None:
        assert self._sid is not None
        event = await self._conn.receive(self._sid)
        match event:
            case Headers(headers=headers, trailers=False) if not self._headers_seen:
                self._headers_seen = True
                http = headers.get(":status", "")
                if http != "200":
                    self._finished = True
                    code = Status.UNAVAILABLE if http in ("502", "503", "504") else Status.UNKNOWN
                    raise RPCError(code, f"HTTP status {http}")
                if "grpc-status" in headers:  # trailers-only
                    self._status(headers)
            case Headers(headers=headers):
                self._status(headers)
            case Data(data=data):
                self._pending += self._decoder.feed(data)
            case End():
                if not self._finished:
                    self._finished = True
                    raise RPCError(Status.INTERNAL, "stream ended without a status")
            case Reset(code=error_code):
                self._finished = True
                if error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                    self._refused = True
                    raise RPCError(Status.UNAVAILABLE, "server refused the stream")
                if error_code == h2.errors.ErrorCodes.CANCEL:
                    raise RPCError(Status.CANCELLED, "server cancelled the call")
                raise RPCError(Status.INTERNAL, f"stream reset with HTTP/2 error {error_code}")
            case Closed():
                await self._fail_transport()

    def _status(self, headers: dict[str, str]) -> None:
        self._finished = True
        self._answered = True
        try:
            code = Status(parse_decimal(headers.get("grpc-status", ""), max_digits=2))
        except ValueError:
            raise RPCError(Status.UNKNOWN, "malformed grpc-status") from None
        if code is Status.OK:
            return
        message = wire.decode_grpc_message(headers.get("grpc-message", ""))
        leader = None
        if LEADER_NODE_HEADER in headers:
            leader = LeaderHint(headers[LEADER_NODE_HEADER], headers.get(LEADER_ADDRESS_HEADER, ""))
        raise RPCError(code, message, leader=leader)

    async def send(self, message: Message) -> None:
        """Send one request (client-streaming calls).

        Raises the server's status if it ended the call with an error; if
        it ended it with OK, the message is dropped (responses stay readable).
        """
        if self._sent_all:
            raise RuntimeError("send() after done_sending()")
        await self._send(data=wire.frame(bytes(message)))

    async def done_sending(self) -> None:
        """Half-close: the server's request stream ends. Idempotent."""
        if not self._sent_all:
            self._sent_all = True
            await self._send(end_stream=True)

    async def _send(self, *, data: bytes = b"", end_stream: bool = False) -> None:
        assert self._sid is not None
        if self._finished:
            return
        try:
            await self._conn.send(self._sid, data=data, end_stream=end_stream)
        except StreamGone:
            if self._conn.closed:
                await self._fail_transport()
            # The server ended the stream: its answer says how.
            while not self._finished:
                await self._step()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Resp:
        while not self._pending:
            if self._finished:
                raise StopAsyncIteration
            await self._step()
        raw = self._pending.pop(0)
        try:
            # Every Message a caller names is a generated betterproto2 class.
            checked = parse_checked(cast("type[betterproto2.Message]", self._type), raw)
        except ValueError as e:
            raise RPCError(Status.INTERNAL, f"cannot parse response: {e}") from None
        return cast(Resp, checked)

    async def aclose(self) -> None:
        """Cancel the call on the server if it has not finished; forget it. Shielded."""
        if self._sid is None:
            return
        if self._finished:
            self._conn.forget(self._sid)  # nothing to send: the common case, at once
            return
        with trio.CancelScope(shield=True):
            self._finished = True
            await self._conn.reset(self._sid)
            self._conn.forget(self._sid)


class Channel:
    """gRPC calls to one server; see the module docstring. Use as ``async with``.

    ``connect`` opens a byte stream to the server (called for the first
    call and after the connection broke), within ``connect_timeout``
    seconds; ``authority`` and ``scheme`` fill the request pseudo-headers
    (``http``: cleartext with prior knowledge). ``keepalive`` is
    (interval, timeout) of PINGs, or None for none. Construction does no I/O.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[trio.abc.Stream]],
        authority: str,
        *,
        scheme: str = "http",
        connect_timeout: float = 5.0,
        keepalive: tuple[float, float] | None = None,
    ) -> None:
        self._open = connect
        self._authority = authority
        self._scheme = scheme
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._stack = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._conn: Connection | None = None
        self._lock = trio.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (or the block left)."""
        return self._closed

    async def __aenter__(self) -> Self:
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
        if self._nursery is not None:
            # Keep-alive PINGs sleep between rounds: stop them now.
            self._nursery.cancel_scope.cancel()
        try:
            await self._stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The background tasks (connection readers) never raise, so a
            # group holds the one exception of the block: hand it on as it
            # was, so that ``except`` around the block works.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def aclose(self) -> None:
        """Close the connection; calls in flight and later fail with :class:`ChannelClosed`."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()

    async def unary(
        self,
        path: str,
        request: Message,
        response_type: type[Resp],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> Resp:
        """Call a unary method; return its response or raise :class:`RPCError`."""
        call = await self._start(path, request, response_type, metadata)
        return await single_response(call)

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        request: Message,
        response_type: type[Resp],
        *,
        metadata: Mapping[str, str] | None = None,
        send_deadline: bool = True,
    ) -> AsyncIterator[StreamCall[Resp]]:
        """Call a server-streaming method; iterate the block's value for responses.

        ``send_deadline`` as for :meth:`bidi`.
        """
        call = await self._start(path, request, response_type, metadata, send_deadline)
        try:
            yield call
        finally:
            await call.aclose()

    @asynccontextmanager
    async def bidi(
        self,
        path: str,
        response_type: type[Resp],
        *,
        metadata: Mapping[str, str] | None = None,
        send_deadline: bool = True,
    ) -> AsyncIterator[StreamCall[Resp]]:
        """Call a bidirectional method: ``send()`` requests and iterate for responses.

        ``send_deadline`` False: the caller's deadline is not sent (a stream
        meant to outlive the scope it was opened in).
        """
        call = await self._start(path, None, response_type, metadata, send_deadline)
        try:
            yield call
        finally:
            await call.aclose()

    def _broken(self, conn: Connection) -> None:
        if self._conn is conn:
            self._conn = None
            self._spawn(conn.aclose)

    def _spawn(self, fn: Callable[[], Awaitable[object]]) -> None:
        if self._nursery is not None and not self._closed:
            self._nursery.start_soon(fn)

    async def _start(
        self,
        path: str,
        request: Message | None,
        response_type: type[Resp],
        metadata: Mapping[str, str] | None,
        send_deadline: bool = True,
    ) -> StreamCall[Resp]:
        payload = request_payload(request)
        extra = call_metadata(metadata, deadline=send_deadline)
        for attempt in (1, 2):
            conn = await self._connection()
            call = StreamCall(
                conn, response_type, self._authority, scheme=self._scheme, on_broken=self._broken
            )
            try:
                await call.open(path, payload, extra)
                if payload is not None:
                    await call.wait_headers()
                return call
            except NotTaken as e:
                await call.aclose()
                if e.again:
                    self._broken(conn)
                if self._closed:
                    raise ChannelClosed("channel closed during the call") from e
                if not e.again or attempt == 2:
                    raise e.error from e
            except RPCError as e:
                await call.aclose()
                if self._closed:
                    raise ChannelClosed("channel closed during the call") from e
                raise
            except BaseException:
                await call.aclose()
                raise
        raise AssertionError("unreachable")

    async def _connection(self) -> Connection:
        if self._closed:
            raise ChannelClosed()
        if self._nursery is None:
            raise RuntimeError("a Channel must be used inside its async with block")
        conn = self._conn
        if conn is not None and not conn.closed:
            # The common case, without the lock's scheduling round.
            await trio.lowlevel.checkpoint_if_cancelled()
            return conn
        async with self._lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            if self._conn is not None:
                self._broken(self._conn)
            try:
                with trio.fail_after(self._connect_timeout):
                    stream = await self._open()
                    try:
                        conn = await start_connection(self._nursery, stream, self._keepalive)
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
            except trio.TooSlowError as e:
                if self._closed:
                    raise ChannelClosed() from e
                raise ConnectionLost(
                    f"Timeout: no connection to {self._authority} within {self._connect_timeout}s"
                ) from e
            except (OSError, trio.BrokenResourceError, StreamGone) as e:
                if self._closed:
                    raise ChannelClosed() from e
                _log.debug("cannot reach %s: %r", self._authority, e)
                raise ConnectionLost(f"{self._authority}: {e!r}") from e
            if self._closed:
                await conn.aclose()
                raise ChannelClosed()
            self._conn = conn
            return conn
