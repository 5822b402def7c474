"""The errors of the etcd client (:mod:`metropolis.consensus.client`), one tree.

:class:`EtcdUnavailable`: etcd could not be reached (may pass);
:class:`EtcdClosed`: this client was closed (never passes);
:class:`EtcdAPIError`: etcd answered with an error, its gRPC code in ``code``.
"""

from __future__ import annotations

import os
from pathlib import Path

from metropolis.errors import ConsensusError

__all__ = [
    "GRPC_CANCELED",
    "GRPC_DEADLINE_EXCEEDED",
    "GRPC_FAILED_PRECONDITION",
    "GRPC_INTERNAL",
    "GRPC_INVALID_ARGUMENT",
    "GRPC_NOT_FOUND",
    "GRPC_OUT_OF_RANGE",
    "GRPC_UNAVAILABLE",
    "EtcdAPIError",
    "EtcdClosed",
    "EtcdError",
    "EtcdUnavailable",
    "LeaseExpired",
    "SocketPathTooLong",
    "WatchCompacted",
    "check_socket_path",
]

# gRPC status codes that etcd puts in the gateway's "code" field.
GRPC_CANCELED = 1
GRPC_INVALID_ARGUMENT = 3
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_FAILED_PRECONDITION = 9
GRPC_OUT_OF_RANGE = 11
GRPC_INTERNAL = 13
GRPC_UNAVAILABLE = 14


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
        within :data:`~metropolis.consensus.client.MEMBERSHIP_DEADLINE`
        (raft may have dropped it): its outcome is unknown, so a retry must
        first look whether it applied.
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
