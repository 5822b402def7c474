"""A gRPC client on Trio that calls whichever curator of a list answers.

::

    async with open_client(endpoints, tls.client_context(ca, cert, key)) as client:
        nodes = await client.unary(GET_NODES, GetNodesRequest())
        async with client.stream(WATCH, WatchRequest()) as updates:
            async for update in updates:
                ...

``endpoints`` is the cluster directory as addresses (and, when known, each
curator's public key, which the client then insists on). The client keeps
one HTTP/2 connection, to one curator, and multiplexes every call on it.

**Failover.** A call goes to another curator, transparently, when the
request provably did not run: the connection could not be made (refused,
TLS failure, wrong server key), the connection was already closing, or the
curator answered UNAVAILABLE because it is not the leader, in which case the
leader it names is tried next (by address or node ID). Each endpoint is
tried at most once per call; when all fail the call raises UNAVAILABLE.
One exception: a curator that closed the connection with a GOAWAY that
had not seen the request (curators close idle connections, and a call may
cross that close) is tried once more, on a new connection.
When a connection breaks *during* a call, the call raises UNAVAILABLE (the
request may have run: only the caller knows whether repeating it is safe),
and the next call connects to the next curator in the list. A server-side
stream (Watch) that breaks likewise ends with UNAVAILABLE; re-open it.

**Errors.** Every failure is :class:`~metropolis.rpc.status.RPCError`:
the server's status, UNAVAILABLE for transport failures, UNAUTHENTICATED
when the server's TLS refused our certificate (unknown CA, expired),
DEADLINE_EXCEEDED when the server's deadline (the caller's Trio deadline,
sent as ``grpc-timeout``) passed first; when the caller's own deadline
fires first, the caller simply sees its Trio cancellation.

**Cancellation.** Cancelling a call (or leaving a ``stream`` block early)
resets its HTTP/2 stream (RST_STREAM CANCEL), which cancels the handler on
the server; the connection and other calls go on. Leaving ``open_client``
cancels every call and closes the connection (GOAWAY).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar, cast

import betterproto2
import h2.errors
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.numbers import parse_decimal
from common.protobuf import parse_checked
from metropolis import identity
from metropolis.errors import MetropolisError
from metropolis.proto.common import ClusterDirectory
from metropolis.rpc import auth, tls, wire
from metropolis.rpc.method import Access, Message, Method
from metropolis.rpc.server import LEADER_ADDRESS_HEADER, LEADER_NODE_HEADER
from metropolis.rpc.status import LeaderHint, RPCError, Status
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
    "CURATOR_PORT",
    "KEEPALIVE",
    "Client",
    "Endpoint",
    "StreamCall",
    "endpoints_from_directory",
    "open_client",
]

_log = logging.getLogger("metropolis.rpc.client")

#: TCP port of the curator service on every node (Monogon's).
CURATOR_PORT = 7835
#: Default (interval, timeout) in seconds of keepalive PINGs.
KEEPALIVE = (10.0, 10.0)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


@dataclass(frozen=True)
class Endpoint:
    """A curator to call: address, and its public key if the directory lists it."""

    host: str
    port: int
    public_key: bytes | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def is_leader(self, hint: LeaderHint) -> bool:
        if hint.address and hint.address == self.address:
            return True
        return self.public_key is not None and identity.node_id(self.public_key) == hint.node_id


def _hinted_endpoint(leader: LeaderHint) -> Endpoint | None:
    """The endpoint a leader hint's ``host:port`` names; None if it names none."""
    host, _, port = leader.address.rpartition(":")
    try:
        number = parse_decimal(port, max_digits=5, what="port")
    except ValueError:
        return None
    if not host or not 0 < number < 65536:
        return None
    return Endpoint(host.removeprefix("[").removesuffix("]"), number)


def endpoints_from_directory(
    directory: ClusterDirectory, port: int = CURATOR_PORT
) -> list[Endpoint]:
    """One endpoint per address of each node in the cluster directory, keyed by its node key.

    The directory lists nodes that run curators; binding each address to
    the node's public key means a curator is believed only if it holds
    that node's key. Entries without a key (learnt from the curators, see
    :mod:`metropolis.roleserve.directory`) are reached by address: any
    curator with a certificate of the cluster CA.
    """
    return [
        Endpoint(address.host, port, node.public_key or None)
        for node in directory.nodes
        for address in node.addresses
    ]


class _Retry(MetropolisError):
    """The call did not run on this curator; try another.

    ``again``: the curator closed the connection cleanly (GOAWAY) before
    taking the call, as a server closing an idle connection does; a new
    connection to it may take the call, so it is tried once more first.
    """

    def __init__(
        self, error: RPCError, leader: LeaderHint | None = None, *, again: bool = False
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.leader = leader
        self.again = again


@asynccontextmanager
async def open_client(
    endpoints: Sequence[Endpoint],
    ssl_context: Any,
    *,
    proof_key: Ed25519PrivateKey | None = None,
    connect_timeout: float = 5.0,
    keepalive: tuple[float, float] = KEEPALIVE,
) -> AsyncIterator[Client]:
    """A :class:`Client` for ``endpoints``, usable inside the block.

    ``proof_key`` signs proofs of possession for methods with
    :attr:`Access.PROOF` (register, join); without it, such calls carry only
    the metadata the caller passes. ``keepalive`` is (interval, timeout) of
    HTTP/2 PINGs that detect a curator that vanished without closing.
    """
    if not endpoints:
        raise ValueError("no curator endpoints")
    try:
        async with trio.open_nursery() as nursery:
            client = Client(
                nursery, list(endpoints), ssl_context, proof_key, connect_timeout, keepalive
            )
            try:
                yield client
            finally:
                await client.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The background tasks (connection readers) never raise, so a group
        # holds the one exception of the block: hand it on as it was, so
        # that ``except RPCError`` around the block works.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class Client:
    """Calls curators; made by :func:`open_client` (see the module docstring)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        endpoints: list[Endpoint],
        ssl_context: Any,
        proof_key: Ed25519PrivateKey | None,
        connect_timeout: float,
        keepalive: tuple[float, float],
    ) -> None:
        self._nursery = nursery
        self._endpoints = endpoints
        self._ssl = ssl_context
        self._proof_key = proof_key
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._current = 0
        self._conn: Connection | None = None
        self._conn_endpoint = 0
        self._lock = trio.Lock()

    @property
    def endpoint(self) -> Endpoint:
        """The curator calls go to now (or will connect to next)."""
        return self._endpoints[self._current]

    async def unary(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> Resp:
        """Call a unary method; return its response or raise :class:`RPCError`.

        The caller's Trio deadline (``with trio.fail_after(...)``) is sent as
        ``grpc-timeout``, so the server gives up when the caller does.
        """
        if method.streaming:
            raise ValueError(f"{method.path} is streaming; use stream()")
        call = await self._start(method, request, metadata)
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

    @asynccontextmanager
    async def stream(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StreamCall[Resp]]:
        """Call a server-streaming method; iterate the block's value for responses.

        The iteration ends when the server ends the stream with OK and
        raises :class:`RPCError` otherwise. Leaving the block early cancels
        the call on the server. The caller's Trio deadline is sent as
        ``grpc-timeout``, as for :meth:`unary`.
        """
        if not method.streaming:
            raise ValueError(f"{method.path} is unary; use unary()")
        call = await self._start(method, request, metadata)
        try:
            yield call
        finally:
            await call.aclose()

    @asynccontextmanager
    async def bidi(
        self,
        method: Method[Req, Resp],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StreamCall[Resp]]:
        """Call a bidirectional method: ``send()`` requests, ``done_sending()``,
        and iterate the block's value for responses.

        Unlike unary and server-streaming calls, a curator that is not the
        leader is not skipped transparently (its refusal may come after
        messages were sent): the first read raises its UNAVAILABLE, which
        names the leader. Leaving the block early cancels the call.
        """
        if not method.client_streaming:
            raise ValueError(f"{method.path} is not client-streaming")
        call = await self._start(method, None, metadata)
        try:
            yield call
        finally:
            await call.aclose()

    async def _start(
        self,
        method: Method[Req, Resp],
        request: Req | None,
        metadata: Mapping[str, str] | None,
    ) -> StreamCall[Resp]:
        # A client stream opens with no message; its proof covers b"".
        payload = None if request is None else bytes(request)
        if payload is not None and len(payload) > wire.MAX_MESSAGE:
            raise RPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request of {len(payload)} bytes exceeds {wire.MAX_MESSAGE}",
            )
        extra = dict(metadata or {})
        deadline = trio.current_effective_deadline()
        if deadline != float("inf") and "grpc-timeout" not in extra:
            extra["grpc-timeout"] = wire.encode_timeout(deadline - trio.current_time())
        tried: set[int] = set()
        again = False  # whether a curator's GOAWAY made us try it once more
        last: RPCError | None = None
        while len(tried) < len(self._endpoints):
            tried.add(self._current)
            if method.access is Access.PROOF and self._proof_key is not None:
                # Signed per attempt: each curator must see a fresh, unused proof.
                extra.update(auth.sign_proof(self._proof_key, method.path, payload or b""))
            call: StreamCall[Resp] | None = None
            try:
                conn, endpoint = await self._connection()
                call = StreamCall(self, conn, method.response_type, endpoint)
                await call.open(method.path, payload, extra)
                if payload is not None:
                    await call.wait_headers()
                return call
            except _Retry as retry:
                last = retry.error
                if retry.again and not again:
                    again = True
                    tried.discard(self._current)
                    self._drop()
                else:
                    self._next(retry.leader, tried)
            except BaseException:
                if call is not None:
                    await call.aclose()
                raise
            if call is not None:
                await call.aclose()
        assert last is not None
        raise RPCError(
            Status.UNAVAILABLE,
            f"no curator could take the call: {last.message}",
            leader=last.leader,
        )

    def _next(self, leader: LeaderHint | None, tried: set[int]) -> None:
        """Point at the leader if it is named and untried, else at the next untried curator."""
        self._drop()
        if leader is not None:
            for i, endpoint in enumerate(self._endpoints):
                if i not in tried and endpoint.is_leader(leader):
                    self._current = i
                    return
            hinted = _hinted_endpoint(leader)
            if hinted is not None and not any(e.is_leader(leader) for e in self._endpoints):
                # A leader missing from the directory we were given (it
                # predates that curator): go where the follower says. The
                # server is still checked against the cluster CA; only the
                # binding to a node key is missing.
                self._endpoints.append(hinted)
                self._current = len(self._endpoints) - 1
                return
        for step in range(1, len(self._endpoints) + 1):
            i = (self._current + step) % len(self._endpoints)
            if i not in tried:
                self._current = i
                return

    def _drop(self) -> None:
        """Forget the current connection (it broke, or we move elsewhere); close it in the back.

        Calls still running on it end with UNAVAILABLE: when we move because
        a curator does not lead, its streams (a Watch) should move too.
        """
        conn, self._conn = self._conn, None
        if conn is not None:
            self._nursery.start_soon(conn.aclose)

    def connection_broke(self, conn: Connection, endpoint: Endpoint) -> None:
        """A call saw ``conn`` break: the next call goes to the next curator."""
        if self._conn is conn:
            self._drop()
            self._current = (self._endpoints.index(endpoint) + 1) % len(self._endpoints)

    async def _connection(self) -> tuple[Connection, Endpoint]:
        async with self._lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn, self._endpoints[self._conn_endpoint]
            self._drop()
            endpoint = self._endpoints[self._current]
            try:
                with trio.fail_after(self._connect_timeout):
                    conn = await self._connect(endpoint)
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, StreamGone) as e:
                _log.info("cannot reach curator %s: %r", endpoint.address, e)
                raise _Retry(RPCError(Status.UNAVAILABLE, f"{endpoint.address}: {e!r}")) from e
            except RPCError as e:
                _log.warning("curator %s: %s", endpoint.address, e)
                if e.code is Status.UNAVAILABLE:
                    raise _Retry(e) from e
                raise
            self._conn, self._conn_endpoint = conn, self._current
            return conn, endpoint

    async def _connect(self, endpoint: Endpoint) -> Connection:
        tcp = await trio.open_tcp_stream(endpoint.host, endpoint.port)
        stream = trio.SSLStream(tcp, self._ssl, server_hostname=endpoint.host)
        try:
            await stream.do_handshake()
            if stream.selected_alpn_protocol() != "h2":
                raise RPCError(Status.UNAVAILABLE, "server did not negotiate h2")
            tls.check_server_key(stream, endpoint.public_key)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        conn = Connection(stream, client_side=True)
        self._nursery.start_soon(conn.run)
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
            _raise_if_refused(conn.read_failure)
            raise StreamGone(f"connection closed during setup: {conn.failure!r}")
        self._nursery.start_soon(conn.keepalive, *self._keepalive)
        return conn

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()


class StreamCall(Generic[Resp]):
    """One call in flight: iterate it for responses (see :meth:`Client.stream`)."""

    def __init__(
        self, client: Client, conn: Connection, response_type: type[Resp], endpoint: Endpoint
    ) -> None:
        self._client = client
        self._conn = conn
        self._type = response_type
        self._endpoint = endpoint
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
        #: done_sending() was called (bidirectional calls).
        self._sent_all = False

    async def open(self, path: str, payload: bytes | None, metadata: Mapping[str, str]) -> None:
        headers = [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", path),
            (":authority", self._endpoint.address),
            ("content-type", wire.CONTENT_TYPE),
            ("te", "trailers"),
            ("user-agent", "metropolis-rpc/1"),
            *metadata.items(),
        ]
        try:
            body = None if payload is None else wire.frame(payload)
            self._sid = await self._conn.open_stream(headers, body)
        except StreamGone as e:
            # The request did not leave whole (a write failed), so no curator
            # ran it: safe to try another. But in TLS 1.3 a refused client
            # certificate shows only after the handshake, as a closed
            # connection: that is no reason to try elsewhere.
            _raise_if_refused(self._conn.read_failure)
            clean = self._conn.failure is None
            raise _Retry(RPCError(Status.UNAVAILABLE, "connection closing"), again=clean) from e

    async def wait_headers(self) -> None:
        """Wait for the response headers; a not-leader or refused stream becomes a retry."""
        while not self._headers_seen and not self._finished:
            try:
                await self._step()
            except RPCError as e:
                # UNAVAILABLE from the curator itself (not a lost connection)
                # before any response: it did not take the call (not the
                # leader, or no leader known yet). Another curator may.
                if e.code is Status.UNAVAILABLE and (self._answered or self._refused):
                    raise _Retry(e, e.leader) from e
                if e.code is Status.UNAVAILABLE and self._unseen:
                    raise _Retry(e, again=True) from e
                raise

    async def _fail_transport(self) -> None:
        self._finished = True
        failure = self._conn.read_failure
        last = self._conn.goaway_last_stream
        if last is not None and self._sid is not None and self._sid > last:
            # The curator said GOAWAY before it saw this stream (RFC 9113
            # 6.8: it did not run): this curator may take it on a new
            # connection (see _Retry), so the client does not move on.
            self._unseen = True
            raise RPCError(Status.UNAVAILABLE, f"{self._endpoint.address} closed the connection")
        self._client.connection_broke(self._conn, self._endpoint)
        _raise_if_refused(failure)
        raise RPCError(Status.UNAVAILABLE, f"connection to {self._endpoint.address} lost")

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
                    raise RPCError(Status.UNAVAILABLE, "curator refused the stream")
                if error_code == h2.errors.ErrorCodes.CANCEL:
                    raise RPCError(Status.CANCELLED, "curator cancelled the call")
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
        """Send one request (bidirectional calls).

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
            # Every Message the method table names is a generated betterproto2 class.
            checked = parse_checked(cast("type[betterproto2.Message]", self._type), raw)
        except ValueError as e:
            raise RPCError(Status.INTERNAL, f"cannot parse response: {e}") from None
        return cast(Resp, checked)

    async def aclose(self) -> None:
        """Cancel the call on the server if it has not finished; forget it. Shielded."""
        if self._sid is None:
            return
        with trio.CancelScope(shield=True):
            if not self._finished:
                self._finished = True
                await self._conn.reset(self._sid)
            self._conn.forget(self._sid)


def _raise_if_refused(failure: BaseException | None) -> None:
    reason = peer_refused_certificate(failure)
    if reason is not None:
        raise RPCError(Status.UNAUTHENTICATED, f"curator refused our certificate: {reason}")
