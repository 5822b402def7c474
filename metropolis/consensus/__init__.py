"""Consensus: this node's etcd member, its peer PKI, and a trio-native etcd client.

* :mod:`.service`: :class:`Service`, the supervised runnable, with its
  :class:`Config`, :class:`Status` and the :class:`JoinCluster` join data.
* :mod:`.client`: the etcd client (:class:`~.client.Client`, namespaced
  :class:`~.client.KV` views).
* :mod:`.peerpki`: the peer CA, certificates and CRL, stored in etcd.
* :mod:`.process`: the etcd child process.
"""

# Re-exported (``X as X``) rather than listed again in an __all__: the list
# lives once, in metropolis.consensus.service.
from metropolis.consensus.service import Config as Config
from metropolis.consensus.service import ConsensusError as ConsensusError
from metropolis.consensus.service import ExistingNode as ExistingNode
from metropolis.consensus.service import JoinCluster as JoinCluster
from metropolis.consensus.service import NotRunning as NotRunning
from metropolis.consensus.service import Service as Service
from metropolis.consensus.service import Status as Status
