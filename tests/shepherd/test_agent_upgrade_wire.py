"""The agent's codec of the upgrade messages, against Google's protobuf.

The agent decodes HeartbeatResponse.upgrade_request (field 101) and writes
HeartbeatRequest.upgrade_report (101) with `shepherd.agent.wire`; protoc's
classes of the server's own definition (``agent_callback.proto``) must
write what the agent reads and read back, byte for byte, what it writes.
The agent's parse is strict: a malformed request is a DecodeError (the
agent then ignores the whole request), never half a request.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.agent import wire
from tests.protoc import google_modules

PROTO_DIR = Path(__file__).resolve().parents[2] / "shepherd" / "proto"
IMAGE_DEFINITION = """
syntax = "proto3";
package monotrio.test.upgradeimage;
message OSImageRef {
  string scheme = 1;
  string host = 2;
  string repository = 3;
  string tag = 4;
  string digest = 5;
}
"""


@pytest.fixture(scope="module")
def callback(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    out = tmp_path_factory.mktemp("pb2")
    sources = [PROTO_DIR / "agent_callback.proto", PROTO_DIR / "hwreport.proto"]
    return google_modules(PROTO_DIR, sources, out)["agent_callback"]


@pytest.fixture(scope="module")
def image_pb(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    src = tmp_path_factory.mktemp("upgrade_image_proto")
    (src / "upgrade_image.proto").write_text(IMAGE_DEFINITION)
    out = tmp_path_factory.mktemp("pb2")
    return google_modules(src, [src / "upgrade_image.proto"], out)["upgrade_image"]


text = st.text(max_size=20)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(max_examples=150, deadline=None)
@given(
    generation=int64,
    image=st.none() | st.tuples(text, text, text, text, text),
    timeout=int64,
    device=text,
    activate=st.booleans(),
    with_install=st.booleans(),
)
def test_agent_reads_the_upgrade_request_google_writes(
    callback: ModuleType,
    image_pb: ModuleType,
    generation: int,
    image: tuple[str, str, str, str, str] | None,
    timeout: int,
    device: str,
    activate: bool,
    with_install: bool,
) -> None:
    theirs = callback.HeartbeatResponse()
    theirs.upgrade_request.SetInParent()
    theirs.upgrade_request.generation = generation
    theirs.upgrade_request.health_timeout_seconds = timeout
    theirs.upgrade_request.root_device = device
    theirs.upgrade_request.activate = activate
    if with_install:
        theirs.installation_request.generation = 7
    expected_image = None
    if image is not None:
        ref = image_pb.OSImageRef(
            scheme=image[0], host=image[1], repository=image[2], tag=image[3], digest=image[4]
        )
        theirs.upgrade_request.os_image = ref.SerializeToString()
        expected_image = wire.OSImageRef(*image)
    encoded = theirs.SerializeToString()
    got = wire.decode_upgrade_request(encoded)
    assert got == wire.UpgradeRequest(generation, expected_image, timeout, device, activate)
    # Both requests in one answer: each is read on its own.
    install = wire.decode_installation_request(encoded)
    assert (install is not None) == with_install


def test_no_upgrade_request_is_none() -> None:
    assert wire.decode_upgrade_request(b"") is None
    assert wire.decode_upgrade_request(b"\x0a\x02\x08\x01") is None  # an install request only


def _request(inner: bytes) -> bytes:
    """HeartbeatResponse{upgrade_request (101): <inner>}."""
    return b"\xaa\x06" + bytes([len(inner)]) + inner


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (_request(b"\x08\x01")[:-1], "past end"),
        (b"\xa8\x06\x01", "want length-delimited"),  # the request as a varint
        (_request(b"\x0a\x00"), "want varint"),  # generation as bytes
        (_request(b"\x18\x0a" + b"\x22\x02\xff\xfe"), "not UTF-8"),  # root_device
        (_request(b"\x12\x00\x12\x00"), "os_image twice"),
        (_request(b"\x12\x02\x0a\x05"), "past end"),  # os_image cut inside
        (_request(b"") + _request(b""), "upgrade_request twice"),
        (_request(b"\x1a\x01x"), "want varint"),  # the timeout as bytes
        (_request(b"\x2a\x01\x01"), "want varint"),  # activate as bytes
    ],
)
def test_malformed_upgrade_requests_are_decode_errors(data: bytes, cause: str) -> None:
    with pytest.raises(wire.DecodeError, match=cause):
        wire.decode_upgrade_request(data)


@settings(max_examples=150, deadline=None)
@given(
    generation=int64,
    state=st.integers(min_value=0, max_value=5),
    detail=text,
    slot=st.sampled_from(["", "a", "b"]),
    machine_id=text,
)
def test_upgrade_report_is_written_as_google_writes_it(
    callback: ModuleType, generation: int, state: int, detail: str, slot: str, machine_id: str
) -> None:
    theirs = callback.HeartbeatRequest(machine_id=machine_id)
    theirs.upgrade_report.SetInParent()
    theirs.upgrade_report.generation = generation
    theirs.upgrade_report.state = state
    theirs.upgrade_report.detail = detail
    theirs.upgrade_report.slot = slot
    ours = wire.UpgradeReport(generation, state, detail, slot)
    encoded = wire.encode_heartbeat_request(machine_id, upgrade_report=ours)
    assert encoded == theirs.SerializeToString(deterministic=True)
    assert callback.HeartbeatRequest.FromString(encoded) == theirs
