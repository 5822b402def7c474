"""The curator: the cluster's management service, kept in etcd.

* :mod:`.state`: where node records and cluster facts live in etcd, and a
  watch of one node's record.
* :mod:`.bootstrap`: :func:`~.bootstrap.bootstrap_cluster`, the one
  idempotent step that makes a new cluster out of a first node.
* :mod:`.election`: leader election on a lease; writes guarded by leadership.
* :mod:`.service`: :class:`~.service.Curator`, the supervised runnable.

The RPC API (nodes watching their roles, the owner managing nodes) is added
on top of :class:`~.service.Curator` later; everything here works on the
etcd view that consensus gives the curator (``namespaced/curator/``).
"""

from metropolis.curator.state import CuratorError

__all__ = ["CuratorError"]
