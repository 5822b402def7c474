"""Where the curator keeps cluster state in etcd, and how it reads it.

Keys, relative to the curator's namespace (``namespaced/curator/``), as in
Monogon's curator::

    /nodes/<node id>              curator.Node         one per node
    /heartbeats/<node id>         text: leader's Unix time (ns) of the node's last status
    /join_keys/<hex join key>     node id (text)       who owns a join key
    /global/initial_owner         curator.InitialOwner
    /global/register_ticket       curator.RegisterTicket, made on the owner's first request
    /leader                       curator.LeaderElectionValue, on the leader's lease
    /cluster-pki/ca/certificate   DER    the cluster CA (signs node certificates)
    /cluster-pki/ca/key           DER    PKCS#8
    /cluster-pki/ca/crl           DER    the cluster CA's CRL; absent while nothing is revoked
    /cluster-pki/issued/node-<id> DER    node certificates issued so far
    /consensus-removals/<node id> raw public key: the node's etcd member is
                                  to be removed by the *next* leader (it was
                                  revoked on the node whose curator led)
    /consensus-rejoins/<node id>  text: Unix time (ns) of a recovery; the node held
                                  ConsensusMember in the snapshot and is to be added
                                  again as a new learner once it is heard from
                                  (:mod:`.rejoin`)
    /recoveries/<time>            JSON: a recovery from a snapshot (:mod:`.rejoin`)
    /test/leader-probe            text: "<node id> <term> <count>", tests only
                                  (:mod:`.probe`)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from metropolis.consensus.client import KV
from metropolis.errors import MetropolisError
from metropolis.proto.curator import Node

__all__ = [
    "CA_CERTIFICATE_KEY",
    "CA_KEY_KEY",
    "CONSENSUS_REJOINS",
    "CONSENSUS_REMOVALS",
    "CRL_KEY",
    "HEARTBEATS",
    "INITIAL_OWNER_KEY",
    "LEADER_KEY",
    "NODES",
    "PROBE_KEY",
    "RECOVERIES",
    "REGISTER_TICKET_KEY",
    "CuratorError",
    "consensus_rejoin_key",
    "consensus_removal_key",
    "heartbeat_key",
    "issued_certificate_key",
    "join_key_key",
    "node_key",
    "parse_node",
    "read_node",
    "watch_node",
]

logger = logging.getLogger("metropolis.curator.state")

INITIAL_OWNER_KEY = b"/global/initial_owner"
REGISTER_TICKET_KEY = b"/global/register_ticket"
LEADER_KEY = b"/leader"
CA_CERTIFICATE_KEY = b"/cluster-pki/ca/certificate"
CA_KEY_KEY = b"/cluster-pki/ca/key"
CRL_KEY = b"/cluster-pki/ca/crl"
#: Prefix of the node records; the rest of a key is the node ID.
NODES = b"/nodes/"
#: Prefix of the heartbeat times; the rest of a key is the node ID.
HEARTBEATS = b"/heartbeats/"
#: Prefix of the pending removals of consensus members (see :mod:`.removal`).
CONSENSUS_REMOVALS = b"/consensus-removals/"
#: Prefix of the nodes to add to etcd again after a recovery (see :mod:`.rejoin`).
CONSENSUS_REJOINS = b"/consensus-rejoins/"
#: Prefix of the records of recoveries from a snapshot (see :mod:`.rejoin`).
RECOVERIES = b"/recoveries/"
#: The leader probe's counter (a test hook, :mod:`.probe`).
PROBE_KEY = b"/test/leader-probe"


class CuratorError(MetropolisError):
    """Cluster state in etcd is missing, damaged, or contradicts the request."""


def _id_part(identifier: str) -> bytes:
    if not identifier or "/" in identifier:
        raise ValueError(f"invalid key part {identifier!r}")
    return identifier.encode()


def node_key(node_id: str) -> bytes:
    return NODES + _id_part(node_id)


def heartbeat_key(node_id: str) -> bytes:
    return HEARTBEATS + _id_part(node_id)


def join_key_key(join_public_key: bytes) -> bytes:
    return b"/join_keys/" + join_public_key.hex().encode()


def consensus_removal_key(node_id: str) -> bytes:
    return CONSENSUS_REMOVALS + _id_part(node_id)


def consensus_rejoin_key(node_id: str) -> bytes:
    return CONSENSUS_REJOINS + _id_part(node_id)


def issued_certificate_key(node_id: str) -> bytes:
    return b"/cluster-pki/issued/node-" + _id_part(node_id)


def parse_node(raw: bytes, node_id: str) -> Node:
    """Parse a node record; :class:`CuratorError` if it is damaged.

    betterproto2 is lenient (truncated input parses to partial records), so
    this catches only what it does reject.
    """
    try:
        return Node.parse(raw)
    except Exception as e:  # betterproto2 raises assorted errors on bad input
        raise CuratorError(f"node record of {node_id} is damaged: {e}") from e


async def read_node(kv: KV, node_id: str) -> Node | None:
    """The record of ``node_id``, or None if there is none."""
    stored = await kv.get(node_key(node_id))
    return None if stored is None else parse_node(stored.value, node_id)


@asynccontextmanager
async def watch_node(kv: KV, node_id: str) -> AsyncIterator[AsyncIterator[Node | None]]:
    """Watch one node's record: the current one first, then every change (None: deleted).

    ``async with watch_node(kv, id) as records: async for record in records``.
    Reads and watches from the same revision, so no change is missed. A
    damaged record is logged and skipped. Errors are the etcd client's (a
    closed client ends the iteration with ``EtcdClosed``).
    """
    key = node_key(node_id)
    first = await kv.range(key)

    async def records() -> AsyncIterator[Node | None]:
        async with kv.watch(key, start_revision=first.revision + 1) as watch:
            yield parse_node(first.kvs[0].value, node_id) if first.kvs else None
            async for response in watch:
                for event in response.events:
                    if event.type == "DELETE":
                        yield None
                        continue
                    try:
                        yield parse_node(event.kv.value, node_id)
                    except CuratorError as e:
                        logger.error("skipping a record: %s", e)

    generator = records()
    try:
        yield generator
    finally:
        await generator.aclose()  # type: ignore[attr-defined]
