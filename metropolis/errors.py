"""The exceptions of the ``metropolis`` package, one hierarchy rooted at
`MetropolisError`.

::

    MetropolisError
    ├── ConsensusError             metropolis.consensus: the etcd member or its data
    │   ├── NotRunning             .membership: the local member is not running (yet)
    │   ├── EtcdExited             .process: the etcd process ended
    │   ├── PeerPKIError           .peerpki: the peer CA, certificates or CRL in etcd
    │   ├── TransportError         .unixhttp: no whole HTTP answer (the etcd client
    │   │   │                      turns it into EtcdUnavailable; never escapes it)
    │   │   └── TransportClosed    the connection pool was closed (-> EtcdClosed)
    │   └── EtcdError              .client: anything the etcd client raises
    │       ├── EtcdUnavailable    etcd cannot be reached (socket gone, refused,
    │       │                      dropped, garbled answer): may pass, retried
    │       ├── EtcdClosed         this client was closed: never passes, never retried
    │       ├── SocketPathTooLong  a UNIX socket path over the kernel's 108 bytes
    │       ├── EtcdAPIError       etcd answered with an error (``code``, ``transient``)
    │       ├── LeaseExpired       the lease is gone
    │       └── WatchCompacted     the revision to watch from was compacted
    ├── CuratorError               metropolis.curator: cluster state in etcd
    │   └── NotLeader              .election: a guarded write after leadership was lost
    ├── NodeRootError              metropolis.roleserve.disk: a node root that is
    │                              missing, foreign or half-written
    ├── BootInfoError              metropolis.roleserve.bootinfo: a boot info file
    │                              that is not what the boot writes
    ├── RPCError                   metropolis.rpc: a call ended with a gRPC status
    │                              other than OK (``code``, ``leader``)
    ├── PKIError                   metropolis.pki: bad key, certificate or CRL
    ├── CredentialsError           metropolis.identity: node credentials do not check out
    ├── LocalStorageError          metropolis.localstorage: the node's on-disk state
    │   ├── InsecureSealError      no TPM, and plain-text sealing was not asked for
    │   ├── UnsafeRootError        a root, folder or file another local user could
    │   │                          swap, change or read (symlink, owner, mode)
    │   └── CorruptFile            a file the node wrote reads back cut short or
    │                              changed (``path``, ``reason``)
    ├── Closed                     metropolis.event: the value was closed
    └── RestartRequested           metropolis.supervisor: a runnable asked to restart

A caller catches the whole package's failures with one ``except
MetropolisError`` and lets anything else (a bug) propagate. Other
exceptions a public function may raise are Python's own, for misuse:
`ValueError` for a bad argument, `RuntimeError` for a call in the wrong
state; and Trio's `trio.Cancelled`, which is never caught here. The etcd
client lets no transport error escape untranslated.
``tests/test_error_trees.py`` checks the tree and what public functions
raise.
"""

from __future__ import annotations

__all__ = ["ConsensusError", "MetropolisError"]


class MetropolisError(Exception):
    """Base class of every error raised by the ``metropolis`` package."""


class ConsensusError(MetropolisError):
    """The consensus service (the local etcd member, its peer PKI, the etcd
    client) cannot start or cannot do what was asked.

    Defined here rather than in `metropolis.consensus.service` so that the
    lower consensus modules (client, process, peerpki) can derive from it
    without importing the service; `metropolis.consensus` re-exports it.
    """
