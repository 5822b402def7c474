"""A Trio-native etcd v3 client over etcd's JSON gateway on a UNIX socket.

Layers, bottom up (each only talks to the one below)::

    UnixHTTP      HTTP/1.1 on the socket (.unixhttp): unary calls, streams
        |
    _Gateway      POST /v3/<path> with a JSON body -> decoded JSON, or a typed error
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

The gateway's wire quirks (etcd 3.4), handled here and nowhere else:

* keys, values and range ends are base64 strings;
* int64 fields are JSON *strings*, and zero/false/empty fields are omitted
  entirely (a missing ``count`` is 0, a failed txn has no ``succeeded``);
* errors are ``{"error", "message", "code"}`` with a gRPC status code and an
  HTTP status derived from it;
* streaming calls (watch, lease keep-alive) answer one JSON object per line,
  each wrapped in ``{"result": ...}``.

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

import base64
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus.unixhttp import (
    ResponseStream,
    TransportClosed,
    TransportError,
    UnixHTTP,
)
from metropolis.errors import ConsensusError

__all__ = [
    "KV",
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
    "KeyValue",
    "Lease",
    "LeaseExpired",
    "Member",
    "Put",
    "PutResult",
    "RangeResult",
    "SocketPathTooLong",
    "TxnResult",
    "Watch",
    "WatchCompacted",
    "WatchResponse",
    "check_socket_path",
]

logger = logging.getLogger("metropolis.consensus.client")

#: Keys and values may be given as text (UTF-8) or bytes; results are bytes.
Key = str | bytes

# gRPC status codes that etcd puts in the gateway's "code" field.
GRPC_CANCELED = 1
GRPC_INVALID_ARGUMENT = 3
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_FAILED_PRECONDITION = 9
GRPC_OUT_OF_RANGE = 11
GRPC_INTERNAL = 13
GRPC_UNAVAILABLE = 14


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


# --- errors -------------------------------------------------------------------


class EtcdError(ConsensusError):
    """Base of every error this client raises."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached: no socket, refused or dropped connection, closed client."""


class EtcdClosed(EtcdError):
    """This client was closed (its owner stopped); no call through it can succeed again.

    Not an :class:`EtcdUnavailable`: code that retries an unreachable etcd
    must not spin on a client that is gone for good.
    """


class SocketPathTooLong(EtcdError):
    """A UNIX socket path is longer than the kernel's 108-byte ``sun_path``."""


#: Size of ``sockaddr_un.sun_path`` on Linux.
_SUN_PATH_MAX = 108


def check_socket_path(path: Path) -> None:
    """Raise :class:`SocketPathTooLong` if ``path`` cannot be connected to.

    Without this check the failure shows up later as an opaque connection
    error (or etcd refusing to start) far from its cause.
    """
    size = len(os.fsencode(path))
    if size > _SUN_PATH_MAX:
        raise SocketPathTooLong(
            f"UNIX socket path is {size} bytes, the kernel allows {_SUN_PATH_MAX}: {path} "
            "(use a shorter root directory)"
        )


class EtcdAPIError(EtcdError):
    """etcd answered with an error.

    ``code`` is the gRPC status code (see the ``GRPC_*`` constants),
    ``http_status`` the gateway's HTTP status, ``message`` etcd's text.
    """

    def __init__(self, message: str, code: int, http_status: int) -> None:
        super().__init__(f"etcd: {message} (grpc code {code}, http {http_status})")
        self.message = message
        self.code = code
        self.http_status = http_status

    @property
    def transient(self) -> bool:
        """Whether retrying the same request later may succeed.

        Membership changes are refused with UNAVAILABLE (503) while the
        cluster is settling after a previous change, and with
        FAILED_PRECONDITION (412) while a learner is not yet in sync or etcd's
        single learner slot is taken. DEADLINE_EXCEEDED (504), or UNAVAILABLE
        "request timed out", means a membership change was not settled
        within :data:`MEMBERSHIP_DEADLINE` (raft may have dropped it): its
        outcome is unknown, so a retry must first look whether it applied.
        """
        return self.code in (GRPC_UNAVAILABLE, GRPC_FAILED_PRECONDITION, GRPC_DEADLINE_EXCEEDED)

    @property
    def stopping(self) -> bool:
        """Whether the member answered so because it is shutting down.

        etcd fails the requests in flight with these (code UNKNOWN) when its
        raft loop stops: after its own member was removed, or on a signal.
        Such a member never serves again; to a caller it is as gone as one
        whose socket refuses.
        """
        return self.message in _STOPPING_MESSAGES

    @property
    def cut_short(self) -> bool:
        """Whether etcd's gateway lost its own gRPC answer midway.

        The gateway relays each call over a gRPC connection to its own
        member; grpc-go reports a message cut off on that link as INTERNAL
        "unexpected EOF" (a known grpc-go flow-control bug of etcd 3.4's
        vintage, seen here on 100 KiB answers under CPU starvation). The
        request may have been applied, so only a read may be sent again.
        """
        return self.code == GRPC_INTERNAL and self.message == "unexpected EOF"


#: etcd's texts for a request cut off by its server stopping
#: (``raft.ErrStopped`` and ``etcdserver.ErrStopped``).
_STOPPING_MESSAGES = frozenset({"raft: stopped", "etcdserver: server stopped"})


class LeaseExpired(EtcdError):
    """The lease no longer exists (expired or revoked)."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"lease {lease_id:x} expired or was revoked")
        self.lease_id = lease_id


class WatchCompacted(EtcdError):
    """A watch asked for revisions that etcd has compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (oldest available {compact_revision})")
        self.compact_revision = compact_revision


# --- records ------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """One key as stored, with its revisions. ``key`` is relative to the view's prefix."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class RangeResult:
    kvs: list[KeyValue]
    #: Number of keys in the range (may exceed ``len(kvs)`` with a limit).
    count: int
    #: Whether more keys than returned are in the range.
    more: bool
    #: Store revision at which the range was read.
    revision: int


@dataclass(frozen=True)
class PutResult:
    revision: int


@dataclass(frozen=True)
class DeleteResult:
    deleted: int
    revision: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    #: One result per operation of the branch that ran, in order.
    responses: list[RangeResult | PutResult | DeleteResult]
    revision: int


@dataclass(frozen=True)
class Lease:
    id: int
    ttl: int


@dataclass(frozen=True)
class Event:
    type: Literal["PUT", "DELETE"]
    #: For a DELETE, only ``key`` and ``mod_revision`` are meaningful.
    kv: KeyValue


@dataclass(frozen=True)
class WatchResponse:
    events: list[Event]
    #: Store revision when etcd sent this batch.
    revision: int


@dataclass(frozen=True)
class Member:
    id: int
    #: Empty until the member has started and published its name.
    name: str
    peer_urls: list[str]
    client_urls: list[str]
    is_learner: bool


@dataclass(frozen=True)
class EndpointStatus:
    """What the etcd member behind this socket reports about itself."""

    member_id: int
    leader: int
    revision: int
    raft_term: int
    raft_index: int
    version: str
    #: A learner does not vote (yet); etcd 3.4 says so in its status.
    is_learner: bool = False


# --- transaction building blocks ----------------------------------------------

_OPS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """A txn guard on one key. Build with the classmethods, e.g. ``Compare.absent(k)``."""

    key: Key
    target: Literal["VALUE", "CREATE", "MOD", "VERSION"]
    op: CompareOp
    operand: bytes | int

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"compare op must be one of {sorted(_OPS)}, got {self.op!r}")

    @classmethod
    def value(cls, key: Key, op: CompareOp, value: Key) -> Compare:
        return cls(key, "VALUE", op, _b(value))

    @classmethod
    def create_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        return cls(key, "CREATE", op, revision)

    @classmethod
    def mod_revision(cls, key: Key, op: CompareOp, revision: int) -> Compare:
        return cls(key, "MOD", op, revision)

    @classmethod
    def version(cls, key: Key, op: CompareOp, version: int) -> Compare:
        return cls(key, "VERSION", op, version)

    @classmethod
    def absent(cls, key: Key) -> Compare:
        """True while ``key`` does not exist (a missing key has create revision 0)."""
        return cls.create_revision(key, "==", 0)


@dataclass(frozen=True)
class Get:
    key: Key
    prefix: bool = False
    #: Answered from the member's own applied state, without asking the
    #: leader (:meth:`KV.range`). A transaction of serializable gets only
    #: is serializable; one linearizable get makes all of it linearizable.
    serializable: bool = False


@dataclass(frozen=True)
class Put:
    key: Key
    value: Key
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: Key
    prefix: bool = False


Op = Get | Put | Delete


# --- wire helpers -------------------------------------------------------------


def _b(data: Key) -> bytes:
    return data.encode() if isinstance(data, str) else data


def _enc(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _dec(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _int(obj: dict[str, Any], name: str) -> int:
    # int64s arrive as strings, and zero values are omitted.
    return int(obj.get(name, 0))


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``.

    An all-0xff (or empty) prefix has no such key; etcd spells "to the end
    of the keyspace" as a single zero byte.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\x00"
    return stripped[:-1] + bytes([stripped[-1] + 1])


# --- the gateway --------------------------------------------------------------


class _Gateway:
    """JSON calls to etcd's gateway; turns transport and API failures into typed errors."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        check_socket_path(socket_path)
        self.socket_path = socket_path
        # One lean HTTP/1.1 client (see unixhttp): unary calls on a pool of
        # kept-alive connections, each stream on a connection of its own.
        self._unary = UnixHTTP(
            socket_path, timeout=timeout, connect_timeout=min(timeout, 2.0), host="etcd"
        )
        self._timeout = timeout

    async def aclose(self) -> None:
        self._unary.close()

    @property
    def closed(self) -> bool:
        return self._unary.closed

    def _unavailable(self, e: Exception) -> EtcdUnavailable:
        return EtcdUnavailable(f"etcd at {self.socket_path} is unavailable: {e!r}")

    async def call(
        self, path: str, body: dict[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        """One unary call. ``deadline`` (seconds) is passed on to etcd, which
        then gives up on the request itself (DEADLINE_EXCEEDED) once it passes."""
        if self.closed:
            raise EtcdClosed("etcd client is closed")
        payload = json.dumps(body, separators=(",", ":")).encode()
        headers: tuple[tuple[str, str], ...] = ()
        if deadline is not None:
            # The gateway turns gRPC's timeout header into the request's context
            # deadline (milliseconds: "<n>m").
            headers = (("Grpc-Timeout", f"{max(1, round(deadline * 1000))}m"),)
        try:
            status, content = await self._unary.post(f"/v3/{path}", payload, headers)
        except TransportClosed as e:
            raise EtcdClosed("etcd client was closed during the call") from e
        except TransportError as e:
            raise self._unavailable(e) from e
        return self._decode(status, content)

    @asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[_Lines]:
        """POST and yield the response's JSON lines (each unwrapped from ``result``).

        Waits for the answer's head at most the client's timeout (the
        gateway sends it with the stream's first object, at once); the
        lines then come as etcd sends them, however late.
        """
        if self.closed:
            raise EtcdClosed("etcd client is closed")
        payload = json.dumps(body, separators=(",", ":")).encode()
        try:
            response = await self._unary.open_stream(
                f"/v3/{path}", payload, head_timeout=self._timeout
            )
        except TransportClosed as e:
            raise EtcdClosed("etcd client was closed during the call") from e
        except TransportError as e:
            raise self._unavailable(e) from e
        try:
            if response.status != 200:
                try:
                    content = await response.read_all()
                except TransportError as e:
                    raise self._unavailable(e) from e
                self._decode(response.status, content)
            yield _Lines(self, response)
        finally:
            response.close()

    @staticmethod
    def _decode(http_status: int, content: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(content)
        except ValueError:
            raise EtcdAPIError(
                content[:200].decode(errors="replace") or "empty response",
                code=0,
                http_status=http_status,
            ) from None
        return _check(obj, http_status)


def _check(obj: Any, http_status: int) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise EtcdAPIError(f"unexpected response {obj!r:.200}", 0, http_status)
    error = obj.get("error")
    if isinstance(error, dict):
        # Errors inside a stream are nested: {"error": {"grpc_code", "http_code", "message"}}.
        raise EtcdAPIError(
            str(error.get("message", error)),
            int(error.get("grpc_code", 0)),
            int(error.get("http_code", http_status)),
        )
    if error is not None:
        raise EtcdAPIError(obj.get("message") or str(error), int(obj.get("code", 0)), http_status)
    if http_status != 200:
        raise EtcdAPIError(f"unexpected response {obj!r:.200}", 0, http_status)
    return obj


class _Lines:
    """The lines of one streamed gateway response, decoded."""

    def __init__(self, gateway: _Gateway, response: ResponseStream) -> None:
        self._gateway = gateway
        self._response = response

    async def next(self) -> dict[str, Any]:
        """Return the next object; :class:`EtcdUnavailable` when the stream ends or breaks."""
        while True:
            try:
                line = await self._response.line()
            except TransportError as e:
                # Also when this client was closed: the caller looks at that.
                raise self._gateway._unavailable(e) from e
            if line is None:
                raise EtcdUnavailable("etcd closed the stream")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise EtcdAPIError(f"undecodable stream line {line[:200]!r}", 0, 200) from None
            try:
                obj = _check(obj, 200)
                result = obj.get("result", obj)
                return _check(result, 200)
            except EtcdAPIError as e:
                # The gateway ends a stream with UNAVAILABLE ("transport is
                # closing") when etcd goes away under it, or with CANCELED
                # ("the client connection is closing") when etcd shuts down
                # gracefully: which one depends on a race inside etcd. We
                # never cancel a stream we still read, so both mean etcd left.
                if e.code in (GRPC_UNAVAILABLE, GRPC_CANCELED):
                    raise EtcdUnavailable(f"etcd stream ended: {e.message}") from e
                raise


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

    def __init__(self, gateway: _Gateway, prefix: bytes = b"") -> None:
        self._gw = gateway
        self.prefix = prefix

    def namespaced(self, prefix: Key) -> KV:
        """A view of the keys under ``prefix`` (appended to this view's prefix)."""
        prefix = _b(prefix)
        if not prefix:
            raise ValueError("a namespace prefix must not be empty")
        return KV(self._gw, self.prefix + prefix)

    # -- keys

    def _range_body(self, key: Key, prefix: bool, serializable: bool = False) -> dict[str, Any]:
        full = self.prefix + _b(key)
        body: dict[str, Any] = {"key": _enc(full)}
        if prefix:
            # etcd rejects an empty key; "from \\0 to the end" is how it
            # spells the whole keyspace.
            body = {"key": _enc(full or b"\x00"), "range_end": _enc(_prefix_end(full))}
        if serializable:
            body["serializable"] = True
        return body

    def _kv(self, raw: dict[str, Any]) -> KeyValue:
        key = _dec(raw.get("key"))
        if not key.startswith(self.prefix):
            # Cannot happen for ranges clamped to our prefix; a violation
            # means a bug that would leak another namespace's data.
            raise EtcdError(f"key {key!r} outside namespace {self.prefix!r}")
        return KeyValue(
            key=key[len(self.prefix) :],
            value=_dec(raw.get("value")),
            create_revision=_int(raw, "create_revision"),
            mod_revision=_int(raw, "mod_revision"),
            version=_int(raw, "version"),
            lease=_int(raw, "lease"),
        )

    def _range_result(self, obj: dict[str, Any]) -> RangeResult:
        return RangeResult(
            kvs=[self._kv(kv) for kv in obj.get("kvs", [])],
            count=_int(obj, "count"),
            more=bool(obj.get("more", False)),
            revision=_int(obj.get("header", {}), "revision"),
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
        body = {"key": _enc(self.prefix + _b(key)), "value": _enc(_b(value))}
        if lease:
            body["lease"] = str(lease)
        obj = await self._gw.call("kv/put", body)
        return PutResult(revision=_int(obj.get("header", {}), "revision"))

    async def delete(self, key: Key, *, prefix: bool = False) -> DeleteResult:
        """Delete ``key`` (or all keys under it if ``prefix``); returns how many went."""
        obj = await self._gw.call("kv/deleterange", self._range_body(key, prefix))
        return DeleteResult(
            deleted=_int(obj, "deleted"), revision=_int(obj.get("header", {}), "revision")
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
                responses.append(PutResult(_int(r["response_put"].get("header", {}), "revision")))
            elif "response_delete_range" in r:
                d = r["response_delete_range"]
                revision = _int(d.get("header", {}), "revision")
                responses.append(DeleteResult(_int(d, "deleted"), revision))
            else:
                raise EtcdAPIError(f"unknown txn response {r!r:.200}", 0, 200)
        return TxnResult(
            # A failed txn omits "succeeded" (false is the zero value).
            succeeded=bool(obj.get("succeeded", False)),
            responses=responses,
            revision=_int(obj.get("header", {}), "revision"),
        )

    def _compare(self, c: Compare) -> dict[str, Any]:
        field_name = {
            "VALUE": "value",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "VERSION": "version",
        }[c.target]
        operand = _enc(c.operand) if isinstance(c.operand, bytes) else str(c.operand)
        return {
            "key": _enc(self.prefix + _b(c.key)),
            "target": c.target,
            "result": _OPS[c.op],
            field_name: operand,
        }

    def _op(self, op: Op) -> dict[str, Any]:
        if isinstance(op, Get):
            return {"request_range": self._range_body(op.key, op.prefix, op.serializable)}
        if isinstance(op, Delete):
            return {"request_delete_range": self._range_body(op.key, op.prefix)}
        put = {"key": _enc(self.prefix + _b(op.key)), "value": _enc(_b(op.value))}
        if op.lease:
            put["lease"] = str(op.lease)
        return {"request_put": put}

    # -- leases

    async def grant(self, ttl: int) -> Lease:
        """Create a lease that expires ``ttl`` seconds after its last keep-alive."""
        if ttl <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        obj = await self._gw.call("lease/grant", {"TTL": str(ttl)})
        return Lease(id=_int(obj, "ID"), ttl=_int(obj, "TTL"))

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh the lease once; return its new TTL. :class:`LeaseExpired` if it is gone."""
        async with self._gw.stream("lease/keepalive", {"ID": str(lease_id)}) as lines:
            obj = await lines.next()
        ttl = _int(obj, "TTL")
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
        self._stream: _Lines | None = None
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
            compact = _int(obj, "compact_revision")
            if compact:
                raise WatchCompacted(compact)
            raise EtcdAPIError(obj.get("cancel_reason", "watch canceled by etcd"), 0, 200)
        revision = _int(obj.get("header", {}), "revision")
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
        id=_int(raw, "ID"),
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
        super().__init__(_Gateway(Path(socket_path), timeout))
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
            member_id=_int(obj.get("header", {}), "member_id"),
            leader=_int(obj, "leader"),
            revision=_int(obj.get("header", {}), "revision"),
            raft_term=_int(obj, "raftTerm"),
            raft_index=_int(obj, "raftIndex"),
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
