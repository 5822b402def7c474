"""The cluster directory a node builds from Watch(nodes_in_cluster)."""

from __future__ import annotations

from metropolis import identity, pki
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
)
from metropolis.roleserve.directory import directory_of
from metropolis.roleserve.disk import NodeSettings
from metropolis.roleserve.rolefetch import curator_endpoints
from metropolis.roleserve.values import ClusterMembership


def test_directory_keeps_known_keys_and_is_sorted() -> None:
    known_key = pki.public_key_bytes(pki.generate_key())
    known_id = identity.node_id(known_key)
    other_id = identity.node_id(pki.public_key_bytes(pki.generate_key()))
    old = ClusterDirectory(
        nodes=[
            ClusterDirectoryNode(
                public_key=known_key, addresses=[ClusterDirectoryNodeAddress(host="127.0.0.1")]
            )
        ]
    )
    curators = {other_id: "127.0.0.2", known_id: "127.0.0.1"}
    directory = directory_of(curators, old)
    assert [n.addresses[0].host for n in directory.nodes] == [curators[i] for i in sorted(curators)]
    keys = {n.addresses[0].host: n.public_key for n in directory.nodes}
    assert keys == {"127.0.0.1": known_key, "127.0.0.2": b""}
    # The same set gives the same bytes (so an unchanged set is not re-saved).
    assert bytes(directory_of(dict(reversed(curators.items())), directory)) == bytes(directory)

    # Entries without a key are dialled by address alone (no key to insist on).
    membership = ClusterMembership(known_key, None, directory)
    endpoints = curator_endpoints(NodeSettings(address="127.0.0.9"), membership)
    assert {(e.host, e.public_key) for e in endpoints} == {
        ("127.0.0.1", known_key),
        ("127.0.0.2", None),
    }
