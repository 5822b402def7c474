"""Consensus: this node's etcd member, its peer PKI, and a trio-native etcd client.

* :mod:`.service`: :class:`Service`, the supervised runnable, with its
  :class:`Config`, :class:`Status` and the :class:`JoinCluster` join data.
* :mod:`.client`: the etcd client (:class:`~.client.Client`, namespaced
  :class:`~.client.KV` views).
* :mod:`.peerpki`: the peer CA, certificates and CRL, stored in etcd.
* :mod:`.process`: the etcd child process.
"""

from metropolis.consensus.service import (
    Config,
    ConsensusError,
    ExistingNode,
    JoinCluster,
    NotRunning,
    Service,
    Status,
)

__all__ = [
    "Config",
    "ConsensusError",
    "ExistingNode",
    "JoinCluster",
    "NotRunning",
    "Service",
    "Status",
]
