"""What the etcd client (:mod:`metropolis.consensus.client`) returns and takes:
results as records, and a transaction's compares and operations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "COMPARE_OPS",
    "Compare",
    "CompareOp",
    "Delete",
    "DeleteResult",
    "EndpointStatus",
    "Event",
    "Get",
    "Key",
    "KeyValue",
    "Lease",
    "Member",
    "Op",
    "Put",
    "PutResult",
    "RangeResult",
    "TxnResult",
    "WatchResponse",
]

#: Keys and values may be given as text (UTF-8) or bytes; results are bytes.
Key = str | bytes


def key_bytes(data: Key) -> bytes:
    """A key or value given as text (UTF-8) or bytes, as bytes."""
    return data.encode() if isinstance(data, str) else data


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

#: A compare's operator as the gateway spells it.
COMPARE_OPS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """A txn guard on one key. Build with the classmethods, e.g. ``Compare.absent(k)``."""

    key: Key
    target: Literal["VALUE", "CREATE", "MOD", "VERSION"]
    op: CompareOp
    operand: bytes | int

    def __post_init__(self) -> None:
        if self.op not in COMPARE_OPS:
            raise ValueError(f"compare op must be one of {sorted(COMPARE_OPS)}, got {self.op!r}")

    @classmethod
    def value(cls, key: Key, op: CompareOp, value: Key) -> Compare:
        return cls(key, "VALUE", op, key_bytes(value))

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
