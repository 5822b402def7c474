"""A gRPC client on Trio that calls whichever curator of a list answers.

::

    async with open_client(endpoints, tls.client_context(ca, cert, key)) as client:
        nodes = await client.unary(GET_NODES, GetNodesRequest())
        async with client.stream(WATCH, WatchRequest()) as updates:
            async for update in updates:
                ...

``endpoints`` is the cluster directory as addresses (and, when known, each
curator's public key, which the client then insists on). The client keeps
one HTTP/2 connection, to one curator, and multiplexes every call on it;
its calls are :mod:`~metropolis.rpc.channel`'s (``StreamCall``), with TLS,
server keys and failover added here.

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
from functools import partial
from typing import Any, TypeVar

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.numbers import parse_decimal
from metropolis import identity
from metropolis.proto.common import ClusterDirectory
from metropolis.rpc import auth, tls
from metropolis.rpc.channel import (
    NotTaken,
    StreamCall,
    call_metadata,
    request_payload,
    single_response,
    start_connection,
)
from metropolis.rpc.method import Access, Message, Method
from metropolis.rpc.pipe import Pipe
from metropolis.rpc.status import LeaderHint, RPCError, Status
from metropolis.rpc.transport import Connection, StreamGone

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
        return await single_response(await self._start(method, request, metadata))

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
        payload = request_payload(request)
        extra = call_metadata(metadata)
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
                call = StreamCall(
                    conn,
                    method.response_type,
                    endpoint.address,
                    on_broken=partial(self.connection_broke, endpoint=endpoint),
                )
                await call.open(method.path, payload, extra)
                if payload is not None:
                    await call.wait_headers()
                return call
            except NotTaken as retry:
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
        conn = self._conn
        if conn is not None and not conn.closed:
            # The common case, without the lock's scheduling round.
            await trio.lowlevel.checkpoint_if_cancelled()
            return conn, self._endpoints[self._conn_endpoint]
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
                raise NotTaken(RPCError(Status.UNAVAILABLE, f"{endpoint.address}: {e!r}")) from e
            except RPCError as e:
                _log.warning("curator %s: %s", endpoint.address, e)
                if e.code is Status.UNAVAILABLE:
                    raise NotTaken(e) from e
                raise
            self._conn, self._conn_endpoint = conn, self._current
            return conn, endpoint

    async def _connect(self, endpoint: Endpoint) -> Connection:
        tcp = await trio.open_tcp_stream(endpoint.host, endpoint.port)
        pipe = Pipe(tcp, self._ssl, server_hostname=endpoint.host)
        try:
            await pipe.handshake()
            if pipe.selected_alpn_protocol() != "h2":
                raise RPCError(Status.UNAVAILABLE, "server did not negotiate h2")
            tls.check_server_key(pipe, endpoint.public_key)
        except BaseException:
            await pipe.aclose()
            raise
        return await start_connection(self._nursery, pipe, self._keepalive)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()
