"""The curator: the cluster's management service, kept in etcd.

* :mod:`.state`: where node records and cluster facts live in etcd, and a
  watch of one node's record.
* :mod:`.bootstrap`: :func:`~.bootstrap.bootstrap_cluster`, the one
  idempotent step that makes a new cluster out of a first node.
* :mod:`.election`: leader election on a lease; writes guarded by leadership.
* :mod:`.service`: :class:`~.service.Curator`, the supervised runnable.
* :mod:`.server`: :class:`~.server.CuratorServer`, the RPC server it runs:
  :mod:`.nodeapi` (what nodes call), :mod:`.managementapi` (what the owner
  calls), :mod:`.membership` (ConsensusMember grants and revokes),
  :mod:`.removal` (revoking it from the leader's own node, across two
  terms), all over :mod:`.records` (leader-guarded reads and writes).
* :mod:`.probe`: a test hook that writes while the curator leads.

Everything here works on the etcd view that consensus gives the curator
(``namespaced/curator/``); every key it uses is defined in :mod:`.state`.
"""

from typing import TYPE_CHECKING

from common.lazy import exports

# Imported on first use (common.lazy): a module of the curator does not
# import its state module (and etcd's client) through this package.
if TYPE_CHECKING:
    from metropolis.curator.state import CuratorError as CuratorError
else:
    __getattr__ = exports(
        __name__,
        {
            "metropolis.curator.state": ["CuratorError"],
        },
    )


__all__ = ["CuratorError"]
