"""The node's etcd client (:mod:`metropolis.consensus.client`), over etcd's native gRPC.

The same public surface on the same UNIX socket (``Client``, ``KV``,
``Watch``; the records, errors and transaction building blocks are the
gateway client's own, imported from there), so that ``bench.etcdclient``
can measure the two against each other, and ``bench.etcdswitch`` can run
the node code on either. The node itself keeps the gateway client (its
module docstring says why); ``tests/metropolis/test_etcd_client.py`` runs
every client test against both. Layers, bottom up::

    Channel       gRPC on HTTP/2, cleartext with prior knowledge, on the
                  socket (metropolis.rpc.channel): one connection, every
                  call multiplexed on it
        |
    _Native       one etcd method -> its generated response message, or a
                  typed error (metropolis/proto/etcd_rpc.proto)
        |
    KV            keys, values, transactions, leases, watches -- under a key prefix
        |
    Client(KV)    the root view; adds cluster membership and endpoint status

Errors are the gateway client's: every ``RPCError`` becomes an
:class:`EtcdError`. :class:`EtcdUnavailable`: etcd could not be reached
(socket missing, connection refused or dropped, no answer within the
client's timeout); :class:`EtcdClosed`: this client was closed;
:class:`EtcdAPIError`: etcd answered with an error, with its gRPC code and
the HTTP status etcd's gateway would have given it. Cancellation is plain
Trio cancellation: it interrupts any call (its HTTP/2 stream is reset), and
an interrupted write may or may not have been applied.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import NoReturn, TypeVar

import trio

from common.backoff import Retrier
from metropolis.consensus.client import (
    GRPC_CANCELED,
    GRPC_NOT_FOUND,
    GRPC_UNAVAILABLE,
    MEMBERSHIP_DEADLINE,
    Compare,
    Delete,
    DeleteResult,
    EndpointStatus,
    EtcdAPIError,
    EtcdClosed,
    EtcdError,
    EtcdUnavailable,
    Event,
    Get,
    Key,
    KeyValue,
    Lease,
    LeaseExpired,
    Member,
    Op,
    Put,
    PutResult,
    RangeResult,
    TxnResult,
    WatchCompacted,
    WatchResponse,
    check_socket_path,
    keep_lease_alive,
)
from metropolis.consensus.client import Watch as _GatewayWatch
from metropolis.consensus.etcdrecords import key_bytes as _b
from metropolis.consensus.gateway import prefix_end as _prefix_end
from metropolis.proto.gen import etcdserverpb as pb
from metropolis.proto.gen import mvccpb
from metropolis.rpc import wire
from metropolis.rpc.channel import Channel, ChannelClosed, ConnectionLost, StreamCall
from metropolis.rpc.method import Message
from metropolis.rpc.status import RPCError, Status

__all__ = ["KV", "Client", "Watch"]

logger = logging.getLogger("bench.etcdgrpc")

Resp = TypeVar("Resp", bound=Message)

#: The HTTP status etcd's gateway (grpc-gateway v1) answers for each gRPC code.
_HTTP_STATUS = {
    Status.CANCELLED: 408,
    Status.UNKNOWN: 500,
    Status.INVALID_ARGUMENT: 400,
    Status.DEADLINE_EXCEEDED: 504,
    Status.NOT_FOUND: 404,
    Status.ALREADY_EXISTS: 409,
    Status.PERMISSION_DENIED: 403,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.FAILED_PRECONDITION: 412,
    Status.ABORTED: 409,
    Status.OUT_OF_RANGE: 400,
    Status.UNIMPLEMENTED: 501,
    Status.INTERNAL: 500,
    Status.UNAVAILABLE: 503,
    Status.DATA_LOSS: 500,
    Status.UNAUTHENTICATED: 401,
}

_KV = "/etcdserverpb.KV/"
_LEASE = "/etcdserverpb.Lease/"
_CLUSTER = "/etcdserverpb.Cluster/"
_WATCH = "/etcdserverpb.Watch/Watch"
_STATUS = "/etcdserverpb.Maintenance/Status"

_RESULTS = {
    "==": pb.CompareCompareResult.EQUAL,
    "!=": pb.CompareCompareResult.NOT_EQUAL,
    "<": pb.CompareCompareResult.LESS,
    ">": pb.CompareCompareResult.GREATER,
}
_TARGETS = {
    "VALUE": pb.CompareCompareTarget.VALUE,
    "CREATE": pb.CompareCompareTarget.CREATE,
    "MOD": pb.CompareCompareTarget.MOD,
    "VERSION": pb.CompareCompareTarget.VERSION,
}


def _revision(header: pb.ResponseHeader | None) -> int:
    return header.revision if header is not None else 0


class _Native:
    """Unary and streaming etcd calls on one channel; turns failures into typed errors."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        check_socket_path(socket_path)
        self.socket_path = socket_path
        self._timeout = timeout
        self.channel = Channel(
            partial(trio.open_unix_socket, str(socket_path)),
            "etcd",
            connect_timeout=min(timeout, 2.0),
        )

    @property
    def closed(self) -> bool:
        return self.channel.closed

    def error(self, e: RPCError) -> EtcdError:
        """The :class:`EtcdError` for a failed call."""
        if isinstance(e, ChannelClosed) or self.channel.closed:
            return EtcdClosed("etcd client was closed during the call")
        if isinstance(e, ConnectionLost):
            return EtcdUnavailable(f"etcd at {self.socket_path} is unavailable: {e.message}")
        return EtcdAPIError(e.message or e.code.name, int(e.code), _HTTP_STATUS.get(e.code, 500))

    async def call(
        self,
        path: str,
        request: Message,
        response_type: type[Resp],
        *,
        deadline: float | None = None,
    ) -> Resp:
        """One unary call within the client's timeout. ``deadline`` (seconds) is
        sent to etcd, which then gives up on the request itself (DEADLINE_EXCEEDED)."""
        if self.channel.closed:
            raise EtcdClosed("etcd client is closed")
        metadata = None if deadline is None else {"grpc-timeout": wire.encode_timeout(deadline)}
        with trio.move_on_after(self._timeout) as scope:
            try:
                return await self.channel.unary(path, request, response_type, metadata=metadata)
            except RPCError as e:
                raise self.error(e) from e
        assert scope.cancelled_caught
        raise EtcdUnavailable(f"Timeout: no answer from {self.socket_path} within {self._timeout}s")

    @asynccontextmanager
    async def bidi(self, path: str, response_type: type[Resp]) -> AsyncIterator[StreamCall[Resp]]:
        """A bidirectional call (watch, keep-alive), without a deadline.

        Opening it waits at most for the connection (the channel's connect
        timeout); the caller bounds its first answer itself, if it must.
        """
        if self.channel.closed:
            raise EtcdClosed("etcd client is closed")
        try:
            async with self.channel.bidi(path, response_type, send_deadline=False) as call:
                yield call
        except RPCError as e:
            raise self.error(e) from e

    async def next(self, call: StreamCall[Resp]) -> Resp:
        """The next message of a stream; :class:`EtcdUnavailable` when it ends or breaks."""
        try:
            return await call.__anext__()
        except StopAsyncIteration:
            raise EtcdUnavailable("etcd closed the stream") from None
        except RPCError as e:
            error = self.error(e)
            if isinstance(error, EtcdAPIError) and error.code in (GRPC_UNAVAILABLE, GRPC_CANCELED):
                # etcd ends a stream with UNAVAILABLE or CANCELED when it
                # goes away: we never cancel a stream we still read.
                raise EtcdUnavailable(f"etcd stream ended: {error.message}") from e
            raise error from e

    async def send(self, call: StreamCall[Resp], message: Message) -> None:
        try:
            await call.send(message)
        except RPCError as e:
            raise self.error(e) from e


# --- key-value view -----------------------------------------------------------


class KV:
    """Keys, transactions, leases and watches, all under one key prefix.

    As the gateway client's ``KV``: keys are relative to the
    prefix and ranges clamped to it; leases are cluster-wide. Obtain one
    from :meth:`Client.namespaced`; it shares the parent's connection.
    """

    def __init__(self, native: _Native, prefix: bytes = b"") -> None:
        self._gw = native
        self.prefix = prefix

    def namespaced(self, prefix: Key) -> KV:
        """A view of the keys under ``prefix`` (appended to this view's prefix)."""
        prefix = _b(prefix)
        if not prefix:
            raise ValueError("a namespace prefix must not be empty")
        return KV(self._gw, self.prefix + prefix)

    # -- keys

    def _bounds(self, key: Key, prefix: bool) -> tuple[bytes, bytes]:
        full = self.prefix + _b(key)
        if prefix:
            # etcd rejects an empty key; "from \\0 to the end" is how it
            # spells the whole keyspace.
            return full or b"\x00", _prefix_end(full)
        return full, b""

    def _kv(self, raw: mvccpb.KeyValue | None) -> KeyValue:
        raw = raw or mvccpb.KeyValue()
        if not raw.key.startswith(self.prefix):
            # Cannot happen for ranges clamped to our prefix; a violation
            # means a bug that would leak another namespace's data.
            raise EtcdError(f"key {raw.key!r} outside namespace {self.prefix!r}")
        return KeyValue(
            key=raw.key[len(self.prefix) :],
            value=raw.value,
            create_revision=raw.create_revision,
            mod_revision=raw.mod_revision,
            version=raw.version,
            lease=raw.lease,
        )

    def _range_result(self, r: pb.RangeResponse) -> RangeResult:
        return RangeResult(
            kvs=[self._kv(kv) for kv in r.kvs],
            count=r.count,
            more=r.more,
            revision=_revision(r.header),
        )

    def _range_request(
        self, key: Key, prefix: bool, serializable: bool, limit: int = 0, revision: int = 0
    ) -> pb.RangeRequest:
        start, end = self._bounds(key, prefix)
        return pb.RangeRequest(
            key=start, range_end=end, serializable=serializable, limit=limit, revision=revision
        )

    async def get(self, key: Key) -> KeyValue | None:
        """Return the key, or None if it does not exist."""
        result = await self.range(key)
        return result.kvs[0] if result.kvs else None

    async def range(
        self,
        key: Key,
        *,
        prefix: bool = False,
        limit: int = 0,
        revision: int = 0,
        serializable: bool = False,
    ) -> RangeResult:
        """Read ``key``, or every key starting with it if ``prefix``.

        As :meth:`metropolis.consensus.client.KV.range`: ``limit`` 0 means
        no limit, ``revision`` 0 the latest; ``serializable`` reads this
        member's applied state without asking the leader.
        """
        request = self._range_request(key, prefix, serializable, limit, revision)
        return self._range_result(await self._gw.call(_KV + "Range", request, pb.RangeResponse))

    async def put(self, key: Key, value: Key, *, lease: int = 0) -> PutResult:
        """Set ``key`` to ``value``, attached to ``lease`` if non-zero."""
        request = pb.PutRequest(key=self.prefix + _b(key), value=_b(value), lease=lease)
        response = await self._gw.call(_KV + "Put", request, pb.PutResponse)
        return PutResult(revision=_revision(response.header))

    async def delete(self, key: Key, *, prefix: bool = False) -> DeleteResult:
        """Delete ``key`` (or all keys under it if ``prefix``); returns how many went."""
        start, end = self._bounds(key, prefix)
        request = pb.DeleteRangeRequest(key=start, range_end=end)
        response = await self._gw.call(_KV + "DeleteRange", request, pb.DeleteRangeResponse)
        return DeleteResult(deleted=response.deleted, revision=_revision(response.header))

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Atomically: if every ``compare`` holds, run ``success``, else ``failure``."""
        request = pb.TxnRequest(
            compare=[self._compare(c) for c in compare],
            success=[self._op(op) for op in success],
            failure=[self._op(op) for op in failure],
        )
        response = await self._gw.call(_KV + "Txn", request, pb.TxnResponse)
        responses: list[RangeResult | PutResult | DeleteResult] = []
        for r in response.responses:
            if r.response_range is not None:
                responses.append(self._range_result(r.response_range))
            elif r.response_put is not None:
                responses.append(PutResult(_revision(r.response_put.header)))
            elif r.response_delete_range is not None:
                d = r.response_delete_range
                responses.append(DeleteResult(d.deleted, _revision(d.header)))
            else:
                raise EtcdAPIError(f"unknown txn response {r!r:.200}", 0, 200)
        return TxnResult(
            succeeded=response.succeeded,
            responses=responses,
            revision=_revision(response.header),
        )

    def _compare(self, c: Compare) -> pb.Compare:
        compare = pb.Compare(
            key=self.prefix + _b(c.key), target=_TARGETS[c.target], result=_RESULTS[c.op]
        )
        operand = c.operand
        if isinstance(operand, bytes):
            compare.value = operand
        elif c.target == "CREATE":
            compare.create_revision = operand
        elif c.target == "MOD":
            compare.mod_revision = operand
        else:
            compare.version = operand
        return compare

    def _op(self, op: Op) -> pb.RequestOp:
        if isinstance(op, Get):
            return pb.RequestOp(
                request_range=self._range_request(op.key, op.prefix, op.serializable)
            )
        if isinstance(op, Delete):
            start, end = self._bounds(op.key, op.prefix)
            return pb.RequestOp(
                request_delete_range=pb.DeleteRangeRequest(key=start, range_end=end)
            )
        assert isinstance(op, Put)
        put = pb.PutRequest(key=self.prefix + _b(op.key), value=_b(op.value), lease=op.lease)
        return pb.RequestOp(request_put=put)

    # -- leases

    async def grant(self, ttl: int) -> Lease:
        """Create a lease that expires ``ttl`` seconds after its last keep-alive."""
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        response = await self._gw.call(
            _LEASE + "LeaseGrant", pb.LeaseGrantRequest(ttl=ttl), pb.LeaseGrantResponse
        )
        if response.error:
            raise EtcdAPIError(response.error, 0, 200)
        return Lease(id=response.id, ttl=response.ttl)

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh the lease once; return its new TTL. :class:`LeaseExpired` if it is gone."""
        async with self._gw.bidi(_LEASE + "LeaseKeepAlive", pb.LeaseKeepAliveResponse) as call:
            with trio.move_on_after(self._gw._timeout) as scope:
                await self._gw.send(call, pb.LeaseKeepAliveRequest(id=lease_id))
                response = await self._gw.next(call)
            if scope.cancelled_caught:
                raise EtcdUnavailable(f"no keep-alive answer within {self._gw._timeout}s")
        # etcd answers a keep-alive for an unknown lease with TTL 0.
        if response.ttl <= 0:
            raise LeaseExpired(lease_id)
        return response.ttl

    async def keep_alive(
        self, lease: Lease, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Keep ``lease`` alive until cancelled, as
        :meth:`metropolis.consensus.client.KV.keep_alive` does: every TTL/3;
        an unreachable etcd is retried every second until the lease must have
        expired (then :class:`LeaseExpired`), as is a lease etcd says is gone.
        Signals ``task_status.started()`` after the first successful refresh."""
        await keep_lease_alive(self.keep_alive_once, lease, lambda: self._gw.closed, task_status)

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting its keys. :class:`LeaseExpired` if it is already gone."""
        try:
            await self._gw.call(
                _LEASE + "LeaseRevoke", pb.LeaseRevokeRequest(id=lease_id), pb.LeaseRevokeResponse
            )
        except EtcdAPIError as e:
            if e.code == GRPC_NOT_FOUND:
                raise LeaseExpired(lease_id) from e
            raise

    # -- watches

    def watch(self, key: Key, *, prefix: bool = False, start_revision: int = 0) -> Watch:
        """Watch ``key`` (or everything under it): ``async with kv.watch(...) as w``.

        As :meth:`metropolis.consensus.client.KV.watch`.
        """
        return Watch(self, key, prefix=prefix, start_revision=start_revision)


class Watch:
    """A watch that survives etcd restarts: ``async with``, then ``async for``.

    Behaves as :class:`metropolis.consensus.client.Watch`: every change
    after ``start_revision`` once, in order; a broken stream reconnects,
    with backoff, from the revision after the last delivered event, until
    the caller cancels; :class:`WatchCompacted` if that revision was
    compacted away, :class:`EtcdAPIError` for other errors etcd reports,
    :class:`EtcdClosed` once the client is closed. Each watch is one gRPC
    stream on the client's connection.
    """

    _BACKOFF = _GatewayWatch._BACKOFF

    def __init__(self, kv: KV, key: Key, *, prefix: bool, start_revision: int) -> None:
        self._kv = kv
        self._key = key
        self._prefix = prefix
        #: First revision not yet delivered (0: "now", until the first event).
        self._next_revision = start_revision
        self._call: StreamCall[pb.WatchResponse] | None = None
        self._stack: AsyncExitStack | None = None
        self._pending: WatchResponse | None = None
        self._closed = False

    async def __aenter__(self) -> Watch:
        # Establish the stream before returning, so that every change made
        # after ``async with`` is entered is seen.
        await self._connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        await self._disconnect()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchResponse:
        if self._closed:
            raise StopAsyncIteration
        if self._pending is not None:
            pending = self._pending
            self._pending = None
            return pending
        retrier = Retrier(self._BACKOFF)
        native = self._kv._gw
        while True:
            try:
                if self._call is None:
                    await self._connect()
                assert self._call is not None
                message = await native.next(self._call)
            except EtcdUnavailable as e:
                await self._disconnect()
                if native.closed:
                    raise EtcdClosed("etcd client was closed under the watch") from e
                delay = retrier.next_delay()
                logger.warning("watch on %r broken, reconnecting in %.1fs: %s", self._key, delay, e)
                await trio.sleep(delay)
                continue
            response = await self._handle(message)
            if response is not None:
                return response

    async def _connect(self) -> None:
        native = self._kv._gw
        start, end = self._kv._bounds(self._key, self._prefix)
        create = pb.WatchCreateRequest(key=start, range_end=end, start_revision=self._next_revision)
        stack = AsyncExitStack()
        try:
            call = await stack.enter_async_context(native.bidi(_WATCH, pb.WatchResponse))
            with trio.move_on_after(native._timeout) as scope:
                await native.send(call, pb.WatchRequest(create_request=create))
                # The first message confirms creation (or cancels the watch).
                first = await native.next(call)
            if scope.cancelled_caught:
                raise EtcdUnavailable(f"watch not confirmed within {native._timeout}s")
        except BaseException:
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack, self._call = stack, call
        self._pending = await self._handle(first)

    async def _disconnect(self) -> None:
        stack, self._stack, self._call = self._stack, None, None
        if stack is not None:
            with trio.CancelScope(shield=True):
                await stack.aclose()

    async def _handle(self, message: pb.WatchResponse) -> WatchResponse | None:
        """Turn one stream message into a response, or None for control messages."""
        if message.canceled:
            await self._disconnect()
            if message.compact_revision:
                raise WatchCompacted(message.compact_revision)
            raise EtcdAPIError(message.cancel_reason or "watch canceled by etcd", 0, 200)
        revision = _revision(message.header)
        if not message.events:
            # Creation confirmations and progress notifications.
            if self._next_revision == 0 and revision:
                # Pin "now": a reconnect must resume here, not at the
                # reconnect's own "now", or changes made in between are lost.
                self._next_revision = revision + 1
            return None
        events = [
            Event(
                type="DELETE" if e.type == mvccpb.EventEventType.DELETE else "PUT",
                kv=self._kv._kv(e.kv),
            )
            for e in message.events
        ]
        # Resume after the last *delivered* event, not the header revision:
        # a catch-up batch may have been cut short of it.
        self._next_revision = max(e.kv.mod_revision for e in events) + 1
        return WatchResponse(events=events, revision=revision)


# --- the root client ----------------------------------------------------------


def _member(raw: pb.Member | None) -> Member:
    raw = raw or pb.Member()
    return Member(
        id=raw.id,
        name=raw.name,
        peer_urls=list(raw.peer_ur_ls),
        client_urls=list(raw.client_ur_ls),
        is_learner=raw.is_learner,
    )


class Client(KV):
    """The root view of one etcd member's client socket; owns the connection.

    ::

        async with Client(ephemeral / "client.sock:0") as etcd:
            await etcd.put("a", "b")

    Construction does no I/O (a missing socket shows up as
    :class:`EtcdUnavailable` on the first call); it is used inside its
    ``async with`` block, which runs the connection. ``timeout`` bounds each
    unary call and a stream's set-up (watches and keep-alives then stream
    without a read timeout); ``membership_deadline`` is etcd's own deadline
    for membership changes (see :data:`metropolis.consensus.client.MEMBERSHIP_DEADLINE`).
    """

    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout: float = 30.0,
        membership_deadline: float = MEMBERSHIP_DEADLINE,
    ) -> None:
        super().__init__(_Native(Path(socket_path), timeout))
        self._membership_deadline = membership_deadline

    async def __aenter__(self) -> Client:
        await self._gw.channel.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._gw.channel.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Close the connection. Later calls (also on namespaced views) raise
        :class:`EtcdClosed`."""
        with trio.CancelScope(shield=True):
            await self._gw.channel.aclose()

    async def status(self) -> EndpointStatus:
        r = await self._gw.call(_STATUS, pb.StatusRequest(), pb.StatusResponse)
        header = r.header or pb.ResponseHeader()
        return EndpointStatus(
            member_id=header.member_id,
            leader=r.leader,
            revision=header.revision,
            raft_term=r.raft_term,
            raft_index=r.raft_index,
            version=r.version,
            is_learner=r.is_learner,
        )

    async def compact(self, revision: int) -> None:
        """Discard history before ``revision``; watches from earlier revisions then fail."""
        request = pb.CompactionRequest(revision=revision, physical=True)
        await self._gw.call(_KV + "Compact", request, pb.CompactionResponse)

    async def member_list(self) -> list[Member]:
        r = await self._gw.call(
            _CLUSTER + "MemberList", pb.MemberListRequest(), pb.MemberListResponse
        )
        return [_member(m) for m in r.members]

    async def member_add(self, peer_urls: Iterable[str], *, learner: bool = True) -> Member:
        """Add a member (a non-voting learner by default), bounded by etcd's deadline."""
        member, _ = await self.member_add_listing(peer_urls, learner=learner)
        return member

    async def member_add_listing(
        self, peer_urls: Iterable[str], *, learner: bool = True
    ) -> tuple[Member, list[Member]]:
        """:meth:`member_add`, with the member list etcd sends with its answer."""
        request = pb.MemberAddRequest(peer_ur_ls=list(peer_urls), is_learner=learner)
        r = await self._gw.call(
            _CLUSTER + "MemberAdd",
            request,
            pb.MemberAddResponse,
            deadline=self._membership_deadline,
        )
        return _member(r.member), [_member(m) for m in r.members]

    async def member_promote(self, member_id: int) -> None:
        """Make a learner a voter. FAILED_PRECONDITION while it is not caught up."""
        await self._gw.call(
            _CLUSTER + "MemberPromote",
            pb.MemberPromoteRequest(id=member_id),
            pb.MemberPromoteResponse,
            deadline=self._membership_deadline,
        )

    async def member_remove(self, member_id: int) -> None:
        await self._gw.call(
            _CLUSTER + "MemberRemove",
            pb.MemberRemoveRequest(id=member_id),
            pb.MemberRemoveResponse,
            deadline=self._membership_deadline,
        )
