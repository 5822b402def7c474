"""An etcd member's command line: :class:`ProcessConfig`, and the binary it names.

Kept apart from :mod:`.process` (which runs the command) so that what only
builds or compares a command line (``node recover``, which starts the
node's etcd before the rest of the node is imported) needs neither Trio nor
etcd's client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from metropolis.consensus.settings import SOCKET_NAME, Tuning

__all__ = ["ETCD_BINARY_ENV", "PeerTLS", "ProcessConfig"]

#: Names the etcd binary to run. A node image's entry point
#: (`metropolis.image.entry`) sets it to the etcd the image bundles; unset
#: or empty, ``etcd`` is looked up on PATH.
ETCD_BINARY_ENV = "METROPOLIS_ETCD_BINARY"


@dataclass(frozen=True)
class PeerTLS:
    """Files for mutual TLS between peers: all from the consensus peer CA."""

    ca_certificate: Path
    certificate: Path
    key: Path
    #: Re-read by etcd on every new peer connection; its signature is *not*
    #: checked, so only the owner may be able to write it.
    crl: Path


@dataclass(frozen=True)
class ProcessConfig:
    """Everything an etcd command line needs."""

    name: str
    data_dir: Path
    #: etcd's working directory; the client socket is created here.
    working_dir: Path
    #: ``host:port`` on which peers connect.
    peer_address: str
    #: None only while bootstrapping the PKI: peers are then plain HTTP.
    peer_tls: PeerTLS | None
    #: Members (name -> peer URL) for ``--initial-cluster``; ignored by etcd
    #: once the data directory holds a member.
    initial_cluster: Mapping[str, str]
    cluster_state: Literal["new", "existing"]
    tuning: Tuning = field(default_factory=Tuning)
    cluster_token: str = "metropolis"

    @classmethod
    def standalone(
        cls, name: str, directory: Path, peer_port: int, tuning: Tuning
    ) -> ProcessConfig:
        """A one-member cluster without peer TLS, its files under ``directory``.

        For tools and tests that need a bare etcd; the consensus service
        builds its own configurations. ``peer_port`` must stay the same when
        the member restarts on the same data: etcd recorded the peer URL.
        """
        peer_address = f"127.0.0.1:{peer_port}"
        return cls(
            name=name,
            data_dir=directory / "data",
            working_dir=directory / "run",
            peer_address=peer_address,
            peer_tls=None,
            initial_cluster={name: f"https://{peer_address}"},
            cluster_state="new",
            tuning=tuning,
        )

    @property
    def socket_path(self) -> Path:
        return self.working_dir / SOCKET_NAME

    @property
    def advertised_peer_url(self) -> str:
        # Always advertise https, also during the plain-HTTP PKI bootstrap:
        # the member's URL is recorded in the cluster at creation and must
        # already be the one the TLS-enabled restart serves.
        return f"https://{self.peer_address}"

    def argv(self) -> list[str]:
        listen_scheme = "https" if self.peer_tls else "http"
        client_url = f"unix://{SOCKET_NAME}"
        args = [
            os.environ.get(ETCD_BINARY_ENV) or "etcd",
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={listen_scheme}://{self.peer_address}",
            f"--initial-advertise-peer-urls={self.advertised_peer_url}",
            "--initial-cluster="
            + ",".join(f"{name}={url}" for name, url in sorted(self.initial_cluster.items())),
            f"--initial-cluster-state={self.cluster_state}",
            f"--initial-cluster-token={self.cluster_token}",
            f"--heartbeat-interval={self.tuning.heartbeat_ms}",
            f"--election-timeout={self.tuning.election_ms}",
            f"--strict-reconfig-check={str(self.tuning.member_health_wait).lower()}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.peer_tls:
            args += [
                f"--peer-trusted-ca-file={self.peer_tls.ca_certificate}",
                f"--peer-cert-file={self.peer_tls.certificate}",
                f"--peer-key-file={self.peer_tls.key}",
                f"--peer-crl-file={self.peer_tls.crl}",
                "--peer-client-cert-auth",
            ]
        return args
