"""NodeParameters and OSImageRef are Monogon's on the wire.

betterproto2's classes (``metropolis.proto.configuration``) must write the
same bytes as Google's protobuf runtime and read its encodings back, both
for protoc's classes from our own ``configuration.proto`` and for classes
from a definition written here with the reference's field numbers (Monogon's
metropolis/proto/api configuration.proto and management.proto), so that a
renumbered field in our file would fail here.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metropolis.proto import common, configuration
from tests.protoc import google_modules

PROTO_DIR = Path(__file__).resolve().parents[2] / "metropolis" / "proto"

# The reference's shapes and numbers. Another package (field numbers, not
# names, make the wire format), so that it does not collide with
# configuration.proto in Google's descriptor pool. owner_public_key = 100
# is ours: the reference's ClusterRegister has no such field.
REFERENCE = """
syntax = "proto3";
package monotrio.test.reference.api;
import "common.proto";
message NodeParameters {
  message ClusterBootstrap { bytes owner_public_key = 1; }
  message ClusterRegister {
    metropolis.proto.common.ClusterDirectory cluster_directory = 1;
    bytes register_ticket = 2;
    bytes ca_certificate = 3;
    bytes owner_public_key = 100;
  }
  oneof cluster {
    ClusterBootstrap cluster_bootstrap = 1;
    ClusterRegister cluster_register = 2;
  }
}
message OSImageRef {
  string scheme = 1;
  string host = 2;
  string repository = 3;
  string tag = 4;
  string digest = 5;
}
"""


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> list[ModuleType]:
    """Google's classes: from our configuration.proto, and from REFERENCE."""
    out = tmp_path_factory.mktemp("pb2")
    ref_dir = tmp_path_factory.mktemp("reference")
    (ref_dir / "reference_configuration.proto").write_text(REFERENCE)
    ours = google_modules(
        PROTO_DIR, [PROTO_DIR / "common.proto", PROTO_DIR / "configuration.proto"], out
    )
    ref = google_modules(
        ref_dir, [ref_dir / "reference_configuration.proto"], out, includes=[PROTO_DIR]
    )
    return [ours["configuration"], ref["reference_configuration"]]


def _same(ours: Any, theirs: Any) -> None:
    """Same bytes both ways, and each side reads the other's encoding."""
    raw = theirs.SerializeToString()
    assert bytes(ours) == raw
    assert type(ours).parse(raw) == ours
    assert type(theirs).FromString(bytes(ours)) == theirs


short = st.binary(max_size=40)
text = st.text(max_size=20)
directories = st.lists(st.tuples(short, st.lists(text, max_size=3)), max_size=3)


def _directory(nodes: list[tuple[bytes, list[str]]]) -> common.ClusterDirectory:
    return common.ClusterDirectory(
        nodes=[
            common.ClusterDirectoryNode(
                public_key=key,
                addresses=[common.ClusterDirectoryNodeAddress(host=h) for h in hosts],
            )
            for key, hosts in nodes
        ]
    )


@settings(max_examples=100, deadline=None)
@given(nodes=st.none() | directories, ticket=short, ca=short, owner=short, bootstrap=st.booleans())
def test_node_parameters(
    pb: list[ModuleType],
    nodes: list[tuple[bytes, list[str]]] | None,
    ticket: bytes,
    ca: bytes,
    owner: bytes,
    bootstrap: bool,
) -> None:
    if bootstrap:
        ours = configuration.NodeParameters(
            cluster_bootstrap=configuration.NodeParametersClusterBootstrap(owner_public_key=owner)
        )
    else:
        ours = configuration.NodeParameters(
            cluster_register=configuration.NodeParametersClusterRegister(
                cluster_directory=None if nodes is None else _directory(nodes),
                register_ticket=ticket,
                ca_certificate=ca,
                owner_public_key=owner,
            )
        )
    for module in pb:
        theirs = module.NodeParameters()
        if bootstrap:
            theirs.cluster_bootstrap.owner_public_key = owner
            theirs.cluster_bootstrap.SetInParent()
        else:
            register = theirs.cluster_register
            register.SetInParent()
            register.register_ticket = ticket
            register.ca_certificate = ca
            register.owner_public_key = owner
            if nodes is not None:
                register.cluster_directory.SetInParent()
                for key, hosts in nodes:
                    node = register.cluster_directory.nodes.add(public_key=key)
                    for h in hosts:
                        node.addresses.add(host=h)
        _same(ours, theirs)


def test_no_cluster_is_an_empty_message(pb: list[ModuleType]) -> None:
    for module in pb:
        _same(configuration.NodeParameters(), module.NodeParameters())


@settings(max_examples=100, deadline=None)
@given(scheme=text, host=text, repository=text, tag=text, digest=text)
def test_os_image_ref(
    pb: list[ModuleType], scheme: str, host: str, repository: str, tag: str, digest: str
) -> None:
    fields = {
        "scheme": scheme,
        "host": host,
        "repository": repository,
        "tag": tag,
        "digest": digest,
    }
    for module in pb:
        _same(configuration.OsImageRef(**fields), module.OSImageRef(**fields))
