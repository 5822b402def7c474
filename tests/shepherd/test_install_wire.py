"""The OS installation messages of the agent callback are the reference's on the wire.

Ours (``shepherd/proto/agent_callback.proto``) declare
``MetropolisInstallationRequest.node_parameters`` and ``.os_image`` as
``bytes`` holding a serialized metropolis.proto.api message; the reference
declares them as those messages. Google's runtime, with classes from a
definition written here in the reference's shape (message-typed fields,
the reference's numbers), must write what betterproto2 writes and read it
back, in both directions, and the bytes inside must be the node's own
NodeParameters and OSImageRef (``metropolis.proto.configuration``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protobuf import parse_strict
from metropolis import pki
from metropolis.proto import common, configuration, parameters
from metropolis.proto.management import GetClusterInfoResponse
from shepherd.agent import wire as agent
from shepherd.proto import agent_callback as bp
from tests.protoc import google_modules

METROPOLIS_PROTO = Path(__file__).resolve().parents[2] / "metropolis" / "proto"

# Monogon's cloud/bmaas/server/api/agent.proto, the messages of an
# installation, in its declaration order (os_image before node_parameters).
# Another package, so that it does not collide with agent_callback.proto in
# Google's descriptor pool; Success.node_public_key and
# MetropolisInstallationRequest.node_address (100) are ours.
REFERENCE = """
syntax = "proto3";
package monotrio.test.reference.bmaas;
import "configuration.proto";
message OSInstallationReport {
  int64 generation = 1;
  message Success { bytes node_public_key = 1; }
  message Error { string error = 1; }
  oneof result {
    Success success = 2;
    Error error = 3;
  }
}
message HeartbeatRequest {
  string machine_id = 1;
  OSInstallationReport installation_report = 3;
}
message MetropolisInstallationRequest {
  reserved 1;
  metropolis.proto.api.OSImageRef os_image = 4;
  metropolis.proto.api.NodeParameters node_parameters = 2;
  string root_device = 3;
  string node_address = 100;
}
// The reference's own MetropolisInstallationRequest, without our field.
message PlainMetropolisInstallationRequest {
  reserved 1;
  metropolis.proto.api.OSImageRef os_image = 4;
  metropolis.proto.api.NodeParameters node_parameters = 2;
  string root_device = 3;
}
message OSInstallationRequest {
  int64 generation = 1;
  oneof type {
    MetropolisInstallationRequest metropolis = 2;
  }
}
message HeartbeatResponse {
  OSInstallationRequest installation_request = 1;
}
"""


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """Google's classes for REFERENCE (with metropolis's configuration.proto)."""
    out = tmp_path_factory.mktemp("pb2")
    ref_dir = tmp_path_factory.mktemp("reference")
    (ref_dir / "reference_agent.proto").write_text(REFERENCE)
    google_modules(
        METROPOLIS_PROTO,
        [METROPOLIS_PROTO / "common.proto", METROPOLIS_PROTO / "configuration.proto"],
        out,
    )
    return google_modules(
        ref_dir, [ref_dir / "reference_agent.proto"], out, includes=[METROPOLIS_PROTO]
    )["reference_agent"]


def _same(ours: Any, theirs: Any) -> None:
    """Same bytes both ways, and each side reads the other's encoding."""
    raw = theirs.SerializeToString()
    assert bytes(ours) == raw
    assert type(ours).parse(raw) == ours
    assert type(theirs).FromString(bytes(ours)) == theirs


short = st.binary(max_size=40)
text = st.text(max_size=20)
generations = st.integers(min_value=-(2**63), max_value=2**63 - 1)
register = st.tuples(
    st.lists(st.tuples(short, st.lists(text, max_size=2)), max_size=3), short, short, short
)
image = st.tuples(text, text, text, text, text)


def _node_parameters(spec: tuple[list[tuple[bytes, list[str]]], bytes, bytes, bytes]) -> Any:
    nodes, ticket, ca, owner = spec
    return configuration.NodeParameters(
        cluster_register=configuration.NodeParametersClusterRegister(
            cluster_directory=common.ClusterDirectory(
                nodes=[
                    common.ClusterDirectoryNode(
                        public_key=key,
                        addresses=[common.ClusterDirectoryNodeAddress(host=h) for h in hosts],
                    )
                    for key, hosts in nodes
                ]
            ),
            register_ticket=ticket,
            ca_certificate=ca,
            owner_public_key=owner,
        )
    )


def _image(spec: tuple[str, str, str, str, str]) -> configuration.OsImageRef:
    scheme, host, repository, tag, digest = spec
    return configuration.OsImageRef(
        scheme=scheme, host=host, repository=repository, tag=tag, digest=digest
    )


@settings(max_examples=100, deadline=None)
@given(
    generation=generations,
    metropolis=st.booleans(),
    params=st.none() | register,
    os_image=st.none() | image,
    root_device=text,
    node_address=text,
)
def test_installation_request(
    ref: ModuleType,
    generation: int,
    metropolis: bool,
    params: tuple[list[tuple[bytes, list[str]]], bytes, bytes, bytes] | None,
    os_image: tuple[str, str, str, str, str] | None,
    root_device: str,
    node_address: str,
) -> None:
    node_parameters = None if params is None else _node_parameters(params)
    image_ref = None if os_image is None else _image(os_image)
    ours = bp.HeartbeatResponse(
        installation_request=bp.OsInstallationRequest(
            generation=generation,
            metropolis=(
                bp.MetropolisInstallationRequest(
                    node_parameters=None if node_parameters is None else bytes(node_parameters),
                    root_device=root_device,
                    os_image=None if image_ref is None else bytes(image_ref),
                    node_address=node_address,
                )
                if metropolis
                else None
            ),
        )
    )
    theirs = ref.HeartbeatResponse()
    request = theirs.installation_request
    request.SetInParent()
    request.generation = generation
    if metropolis:
        install = request.metropolis
        install.SetInParent()
        install.root_device = root_device
        install.node_address = node_address
        if node_parameters is not None:
            # Google's message, filled from the node's own class's encoding.
            install.node_parameters.MergeFromString(bytes(node_parameters))
            install.node_parameters.SetInParent()
        if image_ref is not None:
            install.os_image.MergeFromString(bytes(image_ref))
            install.os_image.SetInParent()
    _same(ours, theirs)
    # What the agent gets out of Google's encoding is the node's message.
    parsed = bp.HeartbeatResponse.parse(theirs.SerializeToString())
    assert parsed.installation_request is not None
    got = parsed.installation_request.metropolis
    if not metropolis:
        assert got is None
        return
    assert got is not None
    assert got.node_address == node_address
    if node_parameters is None:
        assert got.node_parameters is None
    else:
        assert got.node_parameters is not None
        assert parse_strict(configuration.NodeParameters, got.node_parameters) == node_parameters
    if image_ref is None:
        assert got.os_image is None
    else:
        assert got.os_image is not None
        assert parse_strict(configuration.OsImageRef, got.os_image) == image_ref


def test_empty_embedded_messages_stay_present(ref: ModuleType) -> None:
    """A NodeParameters or OSImageRef that is set but empty is written as a
    present field of length 0 by the reference's runtime; ours read it as
    b"" (not absent) and write it the same way."""
    theirs = ref.MetropolisInstallationRequest()
    theirs.node_parameters.SetInParent()
    theirs.os_image.SetInParent()
    ours = bp.MetropolisInstallationRequest(node_parameters=b"", os_image=b"")
    _same(ours, theirs)
    assert bp.MetropolisInstallationRequest.parse(theirs.SerializeToString()).node_parameters == b""
    absent = bp.MetropolisInstallationRequest.parse(
        ref.MetropolisInstallationRequest().SerializeToString()
    )
    assert absent.node_parameters is None and absent.os_image is None


@settings(max_examples=100, deadline=None)
@given(
    machine_id=text,
    generation=generations,
    result=st.none() | st.tuples(st.just("success"), short) | st.tuples(st.just("error"), text),
)
def test_installation_report(
    ref: ModuleType,
    machine_id: str,
    generation: int,
    result: tuple[str, bytes] | tuple[str, str] | None,
) -> None:
    report = bp.OsInstallationReport(generation=generation)
    theirs = ref.HeartbeatRequest(machine_id=machine_id)
    theirs.installation_report.SetInParent()
    theirs.installation_report.generation = generation
    if result is not None and result[0] == "success":
        key = result[1]
        assert isinstance(key, bytes)
        report.success = bp.OsInstallationReportSuccess(node_public_key=key)
        theirs.installation_report.success.node_public_key = key
        theirs.installation_report.success.SetInParent()
    elif result is not None:
        message = result[1]
        assert isinstance(message, str)
        report.error = bp.OsInstallationReportError(error=message)
        theirs.installation_report.error.error = message
        theirs.installation_report.error.SetInParent()
    _same(bp.HeartbeatRequest(machine_id=machine_id, installation_report=report), theirs)


def test_the_agent_still_reads_its_session_beside_an_installation() -> None:
    """The agent's own codec reads the installation request (field 1) that
    betterproto2 writes, and still finds the session (field 100) beside it."""
    params = _node_parameters(([(b"k" * 32, ["10.0.0.1"])], b"ticket", b"ca", b"o" * 32))
    response = bp.HeartbeatResponse(
        installation_request=bp.OsInstallationRequest(
            generation=7,
            metropolis=bp.MetropolisInstallationRequest(
                node_parameters=bytes(params),
                root_device="nvme0n1",
                os_image=bytes(_image(("https", "r.example", "os", "", "sha256:00"))),
            ),
        ),
        session=bp.AgentSession(token=b"t", key=b"k" * 32, lifetime_seconds=60),
    )
    assert agent.decode_heartbeat_session(bytes(response)) == agent.AgentSession(
        b"t", b"k" * 32, 60
    )
    request = agent.decode_installation_request(bytes(response))
    assert request is not None and request.metropolis is not None
    assert request.generation == 7
    assert request.metropolis.node_parameters == bytes(params)
    assert request.metropolis.root_device == "nvme0n1"
    assert request.metropolis.os_image == agent.OSImageRef(
        "https", "r.example", "os", "", "sha256:00"
    )


def test_node_parameters_file_through_the_bytes_field(ref: ModuleType, tmp_path: Path) -> None:
    """A parameters file travels inside the request and comes out as a file
    the node reads: fleet (betterproto2, bytes) -> reference runtime
    (message) -> agent side (betterproto2, bytes) -> node (strict read)."""
    ca = pki.new_ca(pki.generate_key(), "cluster CA")
    info = GetClusterInfoResponse(
        cluster_directory=common.ClusterDirectory(
            nodes=[
                common.ClusterDirectoryNode(
                    public_key=pki.public_key_bytes(pki.generate_key()),
                    addresses=[common.ClusterDirectoryNodeAddress(host="10.1.2.3")],
                )
            ]
        ),
        ca_certificate=pki.encode_certificate(ca, pki.Encoding.DER),
    )
    owner = pki.public_key_bytes(pki.generate_key())
    params = parameters.register_parameters(info, b"ticket", owner)
    sent = bp.OsInstallationRequest(
        generation=3,
        metropolis=bp.MetropolisInstallationRequest(
            node_parameters=parameters.encode(params), root_device="sda"
        ),
    )
    theirs = ref.OSInstallationRequest.FromString(bytes(sent))
    assert theirs.metropolis.node_parameters.cluster_register.owner_public_key == owner
    assert theirs.metropolis.node_parameters.cluster_register.register_ticket == b"ticket"
    got = bp.OsInstallationRequest.parse(theirs.SerializeToString())
    assert got.metropolis is not None and got.metropolis.node_parameters is not None
    path = tmp_path / "node.params"
    path.write_bytes(got.metropolis.node_parameters)  # what the agent does with them
    assert parameters.read(path) == params


@settings(max_examples=50, deadline=None)
@given(node_address=text, root_device=text)
def test_node_address_is_an_extension_the_reference_skips(
    ref: ModuleType, node_address: str, root_device: str
) -> None:
    """node_address (100) is ours: the reference's own message reads a
    request that carries it, keeps every field it knows, and writes the
    unknown field back unchanged, so ours reads the address again."""
    params = _node_parameters(([(b"k" * 32, ["10.0.0.1"])], b"ticket", b"ca", b"o" * 32))
    ours = bp.MetropolisInstallationRequest(
        node_parameters=bytes(params),
        root_device=root_device,
        node_address=node_address,
    )
    plain = ref.PlainMetropolisInstallationRequest.FromString(bytes(ours))
    assert plain.root_device == root_device
    assert plain.node_parameters.cluster_register.register_ticket == b"ticket"
    back = bp.MetropolisInstallationRequest.parse(plain.SerializeToString())
    assert back == ours
    # Without the address, ours is the reference's message byte for byte.
    ours.node_address = ""
    reference = ref.PlainMetropolisInstallationRequest(root_device=root_device)
    reference.node_parameters.MergeFromString(bytes(params))
    assert bytes(ours) == reference.SerializeToString()
