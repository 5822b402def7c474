"""Consensus: this node's etcd member, its peer PKI, and a trio-native etcd client.

* :mod:`.service`: :class:`Service`, the supervised runnable (the member's lifecycle).
* :mod:`.config`: its :class:`Config`, and where the curator's keys live.
* :mod:`.join`: :class:`JoinCluster`, the join data a new member starts from.
* :mod:`.membership`: :class:`Status`, which adds and removes members.
* :mod:`.promoter`: the raft leader's promotion of learners to voters.
* :mod:`.removal`: etcd's own exit once its member is removed, told from a crash.
* :mod:`.crlsync`: etcd's peer CRL, kept on disk for etcd to read.
* :mod:`.client`: the etcd client (:class:`~.client.Client`, namespaced
  :class:`~.client.KV` views).
* :mod:`.peerpki`: the peer CA, certificates and CRL, stored in etcd.
* :mod:`.process`: running the etcd child process; :mod:`.commandline`,
  its command line; :mod:`.child`, the process itself, and the one
  ``node recover`` starts ahead of the service.
"""

# The package's public face: what the node's other packages use of it.
# Re-exported (``X as X``) so that each name is defined once, in its module.
from typing import TYPE_CHECKING

from common.lazy import exports

# Imported on first use (common.lazy): a module that needs one part of
# consensus (its client, the process's constants) does not import it all.
if TYPE_CHECKING:
    from metropolis.consensus.config import Config as Config
    from metropolis.consensus.join import ExistingNode as ExistingNode
    from metropolis.consensus.join import JoinCluster as JoinCluster
    from metropolis.consensus.membership import NotRunning as NotRunning
    from metropolis.consensus.membership import Status as Status
    from metropolis.consensus.service import Service as Service
    from metropolis.errors import ConsensusError as ConsensusError
else:
    __getattr__ = exports(
        __name__,
        {
            "metropolis.consensus.config": ["Config"],
            "metropolis.consensus.join": ["ExistingNode", "JoinCluster"],
            "metropolis.consensus.membership": ["NotRunning", "Status"],
            "metropolis.consensus.service": ["Service"],
            "metropolis.errors": ["ConsensusError"],
        },
    )
