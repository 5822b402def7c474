"""What a node saves and checks of its etcd member before any of etcd's code runs.

The raft timing a node keeps in its settings (:class:`Tuning`), and its
client socket's name and the longest path it may have, which the command
line checks against ``--root`` before anything is written. Apart from
:mod:`.process` (which re-exports them) so that reading a node's settings
(the owner's commands do) imports nothing of etcd's process or client.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SOCKET_NAME", "SOCKET_PATH_MAX", "Tuning"]

#: The client socket's file name inside the working directory.
SOCKET_NAME = "client.sock:0"

#: The longest client socket path etcd can listen on: ``sun_path`` has 108
#: bytes, and Go wants one of them for the terminating NUL.
SOCKET_PATH_MAX = 107


@dataclass(frozen=True)
class Tuning:
    """Raft timing and etcd's membership health wait. Defaults are etcd's;
    loopback tests can go 5x faster."""

    heartbeat_ms: int = 100
    election_ms: int = 1000
    #: etcd's member health wait (``--strict-reconfig-check``): while True,
    #: etcd refuses a membership change until every voter has been connected
    #: for its health window (5 s, fixed in etcd) and a removal that would
    #: leave too few connected voters, so that a change cannot cost the
    #: quorum. False lets changes through at once: for tests on one
    #: machine, whose members connect over loopback, never for a real
    #: cluster.
    member_health_wait: bool = True
