"""A Trio-native etcd v3 client over etcd's JSON gateway on a UNIX socket.

Layers, bottom up (each only talks to the one below)::

    UnixHTTP      HTTP/1.1 on the socket (.unixhttp): unary calls, streams
        |
    Gateway       POST /v3/<path> with a JSON body -> decoded JSON, or a typed error
                  (.gateway)
        |
    KV            keys, values, transactions, leases, watches -- under a key prefix
        |
    Client(KV)    the root view; adds cluster membership and endpoint status,
                  and owns the HTTP connection pool

Why the JSON gateway and not etcd's native gRPC on the same socket: per
call and per watch event the native path (HTTP/2 framing, HPACK, checked
protobuf) costs this process several times the CPU of this lean HTTP/1.1 and
JSON (``python -m bench.etcdclient`` measures both; ``bench.etcdgrpc`` is that
client).

The gateway's wire quirks (etcd 3.4) are handled in :mod:`.gateway` and
nowhere else; the errors are in :mod:`.etcderrors`, the records in
:mod:`.etcdrecords`; this module re-exports their public names.

Errors: everything raised is an :class:`EtcdError` (transport errors never
escape: every ``unixhttp.TransportError`` becomes one).
:class:`EtcdUnavailable` means etcd could not be reached at all (socket
missing, connection refused or dropped, an answer that is not HTTP, no answer
within the client's timeout), which may pass;
:class:`EtcdClosed` means this client was closed, which never passes, so
nothing retries it (watches and keep-alives raise it at once);
:class:`EtcdAPIError` means etcd answered with an error. Cancellation is
plain Trio cancellation: it interrupts any call, and an interrupted write
may or may not have been applied (as with any etcd client).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, NoReturn

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus.etcderrors import (
    GRPC_CANCELED,
    GRPC_DEADLINE_EXCEEDED,
    GRPC_FAILED_PRECONDITION,
    GRPC_INTERNAL,
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_OUT_OF_RANGE,
    GRPC_UNAVAILABLE,
    EtcdAPIError,
    EtcdClosed,
    EtcdError,
    EtcdUnavailable,
    LeaseExpired,
    SocketPathTooLong,
    WatchCompacted,
    check_socket_path,
)
from metropolis.consensus.etcdrecords import (
    COMPARE_OPS,
    Compare,
    Delete,
    DeleteResult,
    EndpointStatus,
    Event,
    Get,
    Key,
    KeyValue,
    Lease,
    Member,
    Op,
    Put,
    PutResult,
    RangeResult,
    TxnResult,
    WatchResponse,
    key_bytes,
)
from metropolis.consensus.gateway import Gateway, Lines, b64, int_field, prefix_end, unb64

__all__ = [
    "GRPC_CANCELED",
    "GRPC_DEADLINE_EXCEEDED",
    "GRPC_FAILED_PRECONDITION",
    "GRPC_INTERNAL",
    "GRPC_INVALID_ARGUMENT",
    "GRPC_NOT_FOUND",
    "GRPC_OUT_OF_RANGE",
    "GRPC_UNAVAILABLE",
    "KV",
    "MEMBERSHIP_DEADLINE",
    "Client",
    "Compare",
    "Delete",
    "DeleteResult",
    "EndpointStatus",
    "EtcdAPIError",
    "EtcdClosed",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "Get",
    "Key",
    "KeyValue",
    "Lease",
    "LeaseExpired",
    "Member",
    "Op",
    "Put",
    "PutResult",
    "RangeResult",
    "SocketPathTooLong",
    "TxnResult",
    "Watch",
    "WatchCompacted",
    "WatchResponse",
    "check_socket_path",
    "keep_lease_alive",
]

logger = logging.getLogger("metropolis.consensus.client")


#: How long etcd may take to settle a membership change (add, promote,
#: remove) before it answers DEADLINE_EXCEEDED or "request timed out".
#: Without a deadline, a change raft drops is never answered at all: raft
#: lets one change be pending (proposed, not yet applied) at a time and
#: silently replaces any other proposed meanwhile ("ignoring conf change ...
#: possible unapplied conf change" in etcd's log), while etcd waits for that
#: change to apply for as long as the request lives. Two changes at once are
#: ordinary here: the promoter on the raft leader and the curator leader's
#: grants and revokes work independently. etcdctl's own default is 5 s.
MEMBERSHIP_DEADLINE = 5.0

#: The lease keep-alive retries an unreachable etcd every second (but never
#: past the moment the lease must have expired).
_KEEP_ALIVE_RETRY = ExponentialBackoff(initial=1.0, maximum=1.0, multiplier=1.0)

#: A read whose answer the gateway lost midway (`EtcdAPIError.cut_short`)
#: is sent again this many times more, after these waits.
_CUT_SHORT_RETRIES = 2
_CUT_SHORT_RETRY = ExponentialBackoff(initial=0.05, maximum=0.5)


# --- key-value view -----------------------------------------------------------


class KV:
    """Keys, transactions, leases and watches, all under one key prefix.

    Every key passed in is relative to the prefix, and every key returned has
    it stripped, so code written against a ``KV`` cannot see or touch keys
    outside its namespace (ranges are clamped to the prefix). Leases are
    cluster-wide and not namespaced.

    Obtain one from :meth:`Client.namespaced` (or :meth:`KV.namespaced` to
    nest). It shares its parent's connection and is valid while that is open.
    """

    def __init__(self, gateway: Gateway, prefix: bytes = b"") -> None:
        self._gw = gateway
        self.prefix = prefix

    def namespaced(self, prefix: Key) -> KV:
        """A view of the keys under ``prefix`` (appended to this view's prefix)."""
        prefix = key_bytes(prefix)
        if not prefix:
            raise ValueError("a namespace prefix must not be empty")
        return KV(self._gw, self.prefix + prefix)

    # -- keys

    def _range_body(self, key: Key, prefix: bool, serializable: bool = False) -> dict[str, Any]:
        full = self.prefix + key_bytes(key)
        body: dict[str, Any] = {"key": b64(full)}
        if prefix:
            # etcd rejects an empty key; "from \\0 to the end" is how it
            # spells the whole keyspace.
            body = {"key": b64(full or b"\x00"), "range_end": b64(prefix_end(full))}
        if serializable:
            body["serializable"] = True
        return body

    def _kv(self, raw: dict[str, Any]) -> KeyValue:
        key = unb64(raw.get("key"))
        if not key.startswith(self.prefix):
            # Cannot happen for ranges clamped to our prefix; a violation
            # means a bug that would leak another namespace's data.
            raise EtcdError(f"key {key!r} outside namespace {self.prefix!r}")
        return KeyValue(
            key=key[len(self.prefix) :],
            value=unb64(raw.get("value")),
            create_revision=int_field(raw, "create_revision"),
            mod_revision=int_field(raw, "mod_revision"),
            version=int_field(raw, "version"),
            lease=int_field(raw, "lease"),
        )

    def _range_result(self, obj: dict[str, Any]) -> RangeResult:
        return RangeResult(
            kvs=[self._kv(kv) for kv in obj.get("kvs", [])],
            count=int_field(obj, "count"),
            more=bool(obj.get("more", False)),
            revision=int_field(obj.get("header", {}), "revision"),
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

        ``limit`` 0 means no limit; ``revision`` 0 means the latest. Keys come
        sorted by key. Raises :class:`EtcdAPIError` for a compacted or future
        revision.

        ``serializable``: answered from what this member has applied, which
        may lag the cluster's latest writes (etcd's default, linearizable,
        first confirms with the leader that nothing newer is committed: a
        round trip to it, and on the leader a round of heartbeats). A
        learner answers only serializable reads.
        """
        body = self._range_body(key, prefix, serializable)
        if limit:
            body["limit"] = limit
        if revision:
            body["revision"] = revision
        retrier = Retrier(_CUT_SHORT_RETRY)
        while True:
            try:
                return self._range_result(await self._gw.call("kv/range", body))
            except EtcdAPIError as e:
                if not e.cut_short or retrier.failures == _CUT_SHORT_RETRIES:
                    raise
                await retrier.sleep()

    async def put(self, key: Key, value: Key, *, lease: int = 0) -> PutResult:
        """Set ``key`` to ``value``, attached to ``lease`` if non-zero."""
        body = {"key": b64(self.prefix + key_bytes(key)), "value": b64(key_bytes(value))}
        if lease:
            body["lease"] = str(lease)
        obj = await self._gw.call("kv/put", body)
        return PutResult(revision=int_field(obj.get("header", {}), "revision"))

    async def delete(self, key: Key, *, prefix: bool = False) -> DeleteResult:
        """Delete ``key`` (or all keys under it if ``prefix``); returns how many went."""
        obj = await self._gw.call("kv/deleterange", self._range_body(key, prefix))
        return DeleteResult(
            deleted=int_field(obj, "deleted"), revision=int_field(obj.get("header", {}), "revision")
        )

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Atomically: if every ``compare`` holds, run ``success``, else ``failure``.

        A transaction of :class:`Get` only is a read, linearizable unless
        every get is ``serializable`` (see :meth:`range`).
        """
        body = {
            "compare": [self._compare(c) for c in compare],
            "success": [self._op(op) for op in success],
            "failure": [self._op(op) for op in failure],
        }
        obj = await self._gw.call("kv/txn", body)
        responses: list[RangeResult | PutResult | DeleteResult] = []
        for r in obj.get("responses", []):
            if "response_range" in r:
                responses.append(self._range_result(r["response_range"]))
            elif "response_put" in r:
                responses.append(
                    PutResult(int_field(r["response_put"].get("header", {}), "revision"))
                )
            elif "response_delete_range" in r:
                d = r["response_delete_range"]
                revision = int_field(d.get("header", {}), "revision")
                responses.append(DeleteResult(int_field(d, "deleted"), revision))
            else:
                raise EtcdAPIError(f"unknown txn response {r!r:.200}", 0, 200)
        return TxnResult(
            # A failed txn omits "succeeded" (false is the zero value).
            succeeded=bool(obj.get("succeeded", False)),
            responses=responses,
            revision=int_field(obj.get("header", {}), "revision"),
        )

    def _compare(self, c: Compare) -> dict[str, Any]:
        field_name = {
            "VALUE": "value",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "VERSION": "version",
        }[c.target]
        operand = b64(c.operand) if isinstance(c.operand, bytes) else str(c.operand)
        return {
            "key": b64(self.prefix + key_bytes(c.key)),
            "target": c.target,
            "result": COMPARE_OPS[c.op],
            field_name: operand,
        }

    def _op(self, op: Op) -> dict[str, Any]:
        if isinstance(op, Get):
            return {"request_range": self._range_body(op.key, op.prefix, op.serializable)}
        if isinstance(op, Delete):
            return {"request_delete_range": self._range_body(op.key, op.prefix)}
        put = {"key": b64(self.prefix + key_bytes(op.key)), "value": b64(key_bytes(op.value))}
        if op.lease:
            put["lease"] = str(op.lease)
        return {"request_put": put}

    # -- leases

    async def grant(self, ttl: int) -> Lease:
        """Create a lease that expires ``ttl`` seconds after its last keep-alive."""
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        obj = await self._gw.call("lease/grant", {"TTL": str(ttl)})
        return Lease(id=int_field(obj, "ID"), ttl=int_field(obj, "TTL"))

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh the lease once; return its new TTL. :class:`LeaseExpired` if it is gone."""
        async with self._gw.stream("lease/keepalive", {"ID": str(lease_id)}) as lines:
            obj = await lines.next()
        ttl = int_field(obj, "TTL")
        # etcd answers a keep-alive for an unknown lease with TTL 0 (omitted).
        if ttl <= 0:
            raise LeaseExpired(lease_id)
        return ttl

    async def keep_alive(
        self, lease: Lease, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Keep ``lease`` alive until cancelled. Run it in a nursery you own.

        Refreshes every TTL/3. If etcd is unreachable it retries every
        second, and gives up with :class:`LeaseExpired` once the lease must
        have expired (a full TTL without a successful refresh); it also raises
        :class:`LeaseExpired` as soon as etcd says the lease is gone. Signals
        ``task_status.started()`` after the first successful refresh.
        """
        await keep_lease_alive(self.keep_alive_once, lease, lambda: self._gw.closed, task_status)

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting its keys. :class:`LeaseExpired` if it is already gone."""
        try:
            await self._gw.call("lease/revoke", {"ID": str(lease_id)})
        except EtcdAPIError as e:
            if e.code == GRPC_NOT_FOUND:
                raise LeaseExpired(lease_id) from e
            raise

    # -- watches

    def watch(self, key: Key, *, prefix: bool = False, start_revision: int = 0) -> Watch:
        """Watch ``key`` (or everything under it). Use as ``async with kv.watch(...) as w``.

        ``start_revision`` 0 means "changes from now on". Entering the
        context connects (raising :class:`EtcdUnavailable` if etcd is down);
        see :class:`Watch` for what happens after that.
        """
        return Watch(self, key, prefix=prefix, start_revision=start_revision)


async def keep_lease_alive(
    refresh: Callable[[int], Awaitable[int]],
    lease: Lease,
    closed: Callable[[], bool],
    task_status: trio.TaskStatus[None],
) -> NoReturn:
    """The keep-alive loop both etcd clients share: ``refresh(lease_id)``
    returns the new TTL every TTL/3; :class:`EtcdUnavailable` is retried every
    second until the lease must have expired (then :class:`LeaseExpired`), or
    becomes :class:`EtcdClosed` once ``closed()`` says the client is closed.
    Signals ``task_status.started()`` after the first successful refresh."""
    started = False
    deadline = trio.current_time() + lease.ttl
    retrier = Retrier(_KEEP_ALIVE_RETRY)
    while True:
        try:
            ttl = await refresh(lease.id)
        except EtcdUnavailable as e:
            if closed():
                raise EtcdClosed("etcd client was closed under the keep-alive") from e
            if trio.current_time() >= deadline:
                raise LeaseExpired(lease.id) from e
            logger.warning("lease %x keep-alive failed, retrying: %s", lease.id, e)
            await retrier.sleep(at_most=deadline - trio.current_time())
            continue
        retrier.reset()
        deadline = trio.current_time() + ttl
        if not started:
            started = True
            task_status.started()
        await trio.sleep(max(ttl / 3, 0.1))


class Watch:
    """A watch that survives etcd restarts: ``async with``, then ``async for``.

    ::

        async with kv.watch("nodes/", prefix=True, start_revision=rev) as w:
            async for response in w:
                for event in response.events: ...

    Every change after ``start_revision`` is delivered once, in order. When
    the stream breaks later (etcd restarted, socket gone) the watch reconnects,
    with backoff, from the revision after the last event it delivered, so
    nothing is missed or repeated; this retries until the caller cancels.
    Raises :class:`WatchCompacted` if the revision to resume from has been
    compacted away (the caller must re-read state and watch anew), and
    :class:`EtcdAPIError` for other errors etcd reports.
    """

    #: Waits between reconnection attempts: 0.1 s, doubling up to 2 s.
    _BACKOFF = ExponentialBackoff(initial=0.1, maximum=2.0)

    def __init__(self, kv: KV, key: Key, *, prefix: bool, start_revision: int) -> None:
        self._kv = kv
        self._key = key
        self._prefix = prefix
        #: First revision not yet delivered (0: "now", until the first event).
        self._next_revision = start_revision
        self._stream: Lines | None = None
        self._stack: AsyncExitStack | None = None
        #: Events that arrived with the creation confirmation (not seen from
        #: etcd 3.4, but nothing says they cannot).
        self._pending: WatchResponse | None = None
        self._closed = False

    async def __aenter__(self) -> Watch:
        # Establish the stream before returning, so that every change made
        # after ``async with`` is entered is seen: etcd is the one to say
        # what "now" is.
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
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
        while True:
            try:
                if self._stream is None:
                    await self._connect()
                assert self._stream is not None
                obj = await self._stream.next()
            except EtcdUnavailable as e:
                await self._disconnect()
                if self._kv._gw.closed:
                    # The stream broke because the client went away: retrying
                    # would spin. EtcdClosed from _connect says the same.
                    raise EtcdClosed("etcd client was closed under the watch") from e
                delay = retrier.next_delay()
                logger.warning("watch on %r broken, reconnecting in %.1fs: %s", self._key, delay, e)
                await trio.sleep(delay)
                continue
            response = await self._handle(obj)
            if response is not None:
                return response

    async def _connect(self) -> None:
        body = self._kv._range_body(self._key, self._prefix)
        if self._next_revision:
            body["start_revision"] = str(self._next_revision)
        stack = AsyncExitStack()
        try:
            stream = await stack.enter_async_context(
                self._kv._gw.stream("watch", {"create_request": body})
            )
            # The first object confirms creation (or cancels the watch).
            first = await stream.next()
        except BaseException:
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack, self._stream = stack, stream
        self._pending = await self._handle(first)

    async def _disconnect(self) -> None:
        stack, self._stack, self._stream = self._stack, None, None
        if stack is not None:
            with trio.CancelScope(shield=True):
                await stack.aclose()

    async def _handle(self, obj: dict[str, Any]) -> WatchResponse | None:
        """Turn one stream object into a response, or None for control messages."""
        if obj.get("canceled"):
            await self._disconnect()
            compact = int_field(obj, "compact_revision")
            if compact:
                raise WatchCompacted(compact)
            raise EtcdAPIError(obj.get("cancel_reason", "watch canceled by etcd"), 0, 200)
        revision = int_field(obj.get("header", {}), "revision")
        raw_events = obj.get("events", [])
        if not raw_events:
            # Creation confirmations and progress notifications.
            if self._next_revision == 0 and revision:
                # Pin "now": a reconnect must resume here, not at the
                # reconnect's own "now", or changes made in between are lost.
                self._next_revision = revision + 1
            return None
        events = [
            Event(type=e.get("type", "PUT"), kv=self._kv._kv(e.get("kv", {}))) for e in raw_events
        ]
        # Resume after the last *delivered* event, not the header revision:
        # a catch-up batch may have been cut short of it.
        self._next_revision = max(e.kv.mod_revision for e in events) + 1
        return WatchResponse(events=events, revision=revision)


# --- the root client ----------------------------------------------------------


def _member(raw: dict[str, Any]) -> Member:
    return Member(
        id=int_field(raw, "ID"),
        name=raw.get("name", ""),
        peer_urls=list(raw.get("peerURLs", [])),
        client_urls=list(raw.get("clientURLs", [])),
        is_learner=bool(raw.get("isLearner", False)),
    )


class Client(KV):
    """The root view of one etcd member's client socket; owns the connection.

    ::

        async with Client(ephemeral / "client.sock:0") as etcd:
            await etcd.put("a", "b")
            curator = etcd.namespaced("namespaced/curator/")

    Construction does no I/O: a missing socket shows up as
    :class:`EtcdUnavailable` on the first call. ``timeout`` bounds each
    unary call (watches and keep-alives stream without a read timeout);
    ``membership_deadline`` is etcd's own deadline for membership changes
    (see :data:`MEMBERSHIP_DEADLINE`).
    """

    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout: float = 30.0,
        membership_deadline: float = MEMBERSHIP_DEADLINE,
    ) -> None:
        super().__init__(Gateway(Path(socket_path), timeout))
        self._membership_deadline = membership_deadline

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Later calls (also on namespaced views) raise
        :class:`EtcdClosed`."""
        with trio.CancelScope(shield=True):
            await self._gw.aclose()

    async def status(self) -> EndpointStatus:
        obj = await self._gw.call("maintenance/status", {})
        return EndpointStatus(
            member_id=int_field(obj.get("header", {}), "member_id"),
            leader=int_field(obj, "leader"),
            revision=int_field(obj.get("header", {}), "revision"),
            raft_term=int_field(obj, "raftTerm"),
            raft_index=int_field(obj, "raftIndex"),
            version=obj.get("version", ""),
            is_learner=bool(obj.get("isLearner", False)),
        )

    async def compact(self, revision: int) -> None:
        """Discard history before ``revision``; watches from earlier revisions then fail."""
        await self._gw.call("kv/compaction", {"revision": str(revision), "physical": True})

    async def member_list(self) -> list[Member]:
        obj = await self._gw.call("cluster/member/list", {})
        return [_member(m) for m in obj.get("members", [])]

    async def member_add(self, peer_urls: Iterable[str], *, learner: bool = True) -> Member:
        """Add a member (a non-voting learner by default). See :attr:`EtcdAPIError.transient`.

        Like every membership change, bounded by etcd's deadline: a change
        etcd does not settle in time raises DEADLINE_EXCEEDED (or
        UNAVAILABLE), and may or may not have applied.
        """
        member, _ = await self.member_add_listing(peer_urls, learner=learner)
        return member

    async def member_add_listing(
        self, peer_urls: Iterable[str], *, learner: bool = True
    ) -> tuple[Member, list[Member]]:
        """:meth:`member_add`, with the member list etcd sends with its answer.

        The list is the membership right after the addition: a caller that
        needs it saves a ``member_list`` round trip.
        """
        body: dict[str, Any] = {"peerURLs": list(peer_urls)}
        if learner:
            body["isLearner"] = True
        obj = await self._gw.call("cluster/member/add", body, deadline=self._membership_deadline)
        return _member(obj.get("member", {})), [_member(m) for m in obj.get("members", [])]

    async def member_promote(self, member_id: int) -> None:
        """Make a learner a voter. FAILED_PRECONDITION while it is not caught up."""
        await self._gw.call(
            "cluster/member/promote", {"ID": str(member_id)}, deadline=self._membership_deadline
        )

    async def member_remove(self, member_id: int) -> None:
        await self._gw.call(
            "cluster/member/remove", {"ID": str(member_id)}, deadline=self._membership_deadline
        )
