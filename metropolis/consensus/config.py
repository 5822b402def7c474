"""How this node's consensus member runs: :class:`Config`, and where things live."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity
from metropolis.consensus.commandline import PeerTLS, ProcessConfig
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.settings import SOCKET_NAME, Tuning
from metropolis.localstorage import EtcdDataDirectory

__all__ = ["CURATOR_NAMESPACE", "DEFAULT_PEER_PORT", "Config"]

#: Port peers use when nothing else is said (the node's consensus port).
DEFAULT_PEER_PORT = 7834

#: Where the curator keeps its data in etcd.
CURATOR_NAMESPACE = b"namespaced/curator/"


@dataclass(frozen=True)
class Config:
    """How to run this node's consensus member."""

    #: ``data/etcd``: etcd data, peer PKI, CRL.
    data: EtcdDataDirectory
    #: etcd's working directory (``ephemeral/consensus``); the client socket lives here.
    ephemeral: Path
    node_private_key: Ed25519PrivateKey
    #: ``host:port`` to listen on for peers; also the address advertised to them.
    peer_address: str
    #: Set to join an existing cluster; None to bootstrap (or restart from disk).
    join_cluster: JoinCluster | None = None
    tuning: Tuning = field(default_factory=Tuning)
    #: The longest the promoter goes without looking for learners to promote
    #: (it looks at once when one is added, and often while one waits).
    promote_interval: float = 5.0
    #: How long ``add_node`` keeps retrying while etcd refuses membership changes.
    membership_timeout: float = 60.0
    #: Spreads the waits between retried membership changes (seeded in tests).
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    @property
    def node_id(self) -> str:
        return identity.node_id(self.node_private_key.public_key())

    @property
    def peer_url(self) -> str:
        return f"https://{self.peer_address}"

    @property
    def client_socket(self) -> Path:
        """Where etcd's client socket appears while the member runs."""
        return self.ephemeral / SOCKET_NAME

    def joining_process(self) -> ProcessConfig:
        """The command line of this member's etcd as it joins through
        ``join_cluster`` (or restarts on its data with it); ValueError if
        there is no join data.

        The consensus service runs this one; ``node recover`` starts it
        ahead of the service (:mod:`.child`), which takes it over only if
        both are the same.
        """
        join = self.join_cluster
        if join is None:
            raise ValueError("no join data: this member bootstraps or restarts on its data")
        initial = {self.node_id: self.peer_url} | {n.name: n.url for n in join.existing_nodes}
        return self._process(peer_tls=True, initial=initial, state="existing")

    def _process(
        self, *, peer_tls: bool, initial: dict[str, str], state: Literal["new", "existing"]
    ) -> ProcessConfig:
        pki_dir = self.data.peer_pki
        tls = PeerTLS(
            ca_certificate=pki_dir.ca_certificate,
            certificate=pki_dir.certificate,
            key=pki_dir.key,
            crl=self.data.peer_crl,
        )
        return ProcessConfig(
            name=self.node_id,
            data_dir=self.data.data,
            working_dir=self.ephemeral,
            peer_address=self.peer_address,
            peer_tls=tls if peer_tls else None,
            initial_cluster=initial,
            cluster_state=state,
            tuning=self.tuning,
        )
