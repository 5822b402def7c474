"""``node recover``'s preparation of the restored etcd, in a temporary etcd.

What :mod:`metropolis.roleserve.recover` runs once etcdctl has restored the
snapshot into a one-member data directory, when the node has no whole peer
PKI of its own on disk (else the node's curator prepares the data:
:mod:`metropolis.roleserve.recoverpending`): a temporary etcd on it (plain-HTTP
peers, alone on the node, fast raft ticks), through which this node's peer
certificate is taken from the restored peer PKI (the stored one, or a new
one), and its record, the rejoin marks of the other members and the
recovery's record are written (:func:`~metropolis.curator.rejoin.prepare_restored`);
then it is stopped. etcdctl's restore cannot write keys itself, and the peer
CA's key, which the certificate needs, is only in the restored keyspace.

Apart from the procedure so that the command can import these modules
(etcd's process and client, the curator's records) while etcdctl runs.
Errors: those of the temporary etcd (:class:`~metropolis.consensus.process.EtcdExited`),
its client, and :class:`~metropolis.curator.state.CuratorError` for a
snapshot without this node. Cancellation stops the temporary etcd.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from metropolis.consensus import peerpki
from metropolis.consensus.client import Client
from metropolis.consensus.config import CURATOR_NAMESPACE
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.peerhosts import peer_hosts
from metropolis.consensus.process import ProcessConfig, Tuning, run_etcd
from metropolis.curator.rejoin import Recovery, prepare_restored
from metropolis.identity import NodeCredentials
from metropolis.proto.common import NodeRoles

if TYPE_CHECKING:
    from metropolis.roleserve.recover import Checked

__all__ = ["prepare"]

_log = logging.getLogger("metropolis.roleserve.recover")

#: The temporary etcd's raft timing: alone on this node, it elects itself
#: after 1 to 5 ticks of 10 ms, where the node's own timing (etcd's default
#: 100 ms ticks) would keep the recovery waiting up to half a second.
_PREPARE_TUNING = Tuning(heartbeat_ms=10, election_ms=50)


async def prepare(
    checked: Checked, restored: Path, work: Path
) -> tuple[JoinCluster, NodeRoles, Recovery]:
    """Prepare the etcd data restored in ``restored`` (a temporary etcd runs
    in ``work/run``); this node's join data and roles, and the recovery, as
    written there."""
    settings, credentials, manifest = checked.settings, checked.credentials, checked.manifest
    node_id = credentials.node_id
    process = ProcessConfig(
        name=node_id,
        data_dir=restored,
        working_dir=work / "run",
        peer_address=settings.peer_address,
        peer_tls=None,
        initial_cluster={node_id: f"https://{settings.peer_address}"},
        cluster_state="new",
        tuning=_PREPARE_TUNING,
    )
    recovery = Recovery.now(
        node_id,
        revision=manifest.revision,
        taken_at=manifest.taken_at,
        snapshot_node_id=manifest.node_id,
        sha256=manifest.sha256,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(run_etcd, process, logging.getLogger(f"{_log.name}.etcd"))
        async with Client(process.socket_path) as client:
            join = await _own_join(client, credentials, settings.peer_address)
            roles, recovery = await prepare_restored(
                client.namespaced(CURATOR_NAMESPACE), recovery, join.to_proto()
            )
        nursery.cancel_scope.cancel()
    return join, roles, recovery


async def _own_join(client: Client, credentials: NodeCredentials, peer_address: str) -> JoinCluster:
    """This node's join data for its restored member: the peer CA, CRL and its certificate."""
    kv = client.namespaced(peerpki.NAMESPACE)
    node = await peerpki.load_for_node(kv, credentials.node_id)
    certificate = await peerpki.reuse_or_issue(
        kv,
        node.ca,
        credentials.public_key,
        peer_hosts(peer_address),
        node.crl,
        node.stored_certificate,
    )
    return JoinCluster(node.ca.certificate, certificate, node.crl, ())
