"""parse_strict accepts exactly the canonical encodings, where betterproto2's parse takes anything.

Against Google's protobuf runtime (protoc's classes for the same .proto):
whatever parse_strict accepts, Google's parses to the same message and
writes back byte for byte; whatever Google's rejects, parse_strict
rejects too; and it raises nothing but ValueError.
"""

from __future__ import annotations

import datetime
import importlib
import random
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metropolis.proto import common, configuration, management
from metropolis.proto.strict import parse_strict
from tests.protoc import google_modules

PROTO_DIR = Path(__file__).resolve().parents[2] / "metropolis" / "proto"

# Looked up, not imported: the protobuf runtime has no type stubs here.
DecodeError = importlib.import_module("google.protobuf.message").DecodeError


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    out = tmp_path_factory.mktemp("pb2")
    sources = [PROTO_DIR / "common.proto", PROTO_DIR / "configuration.proto"]
    return google_modules(PROTO_DIR, sources, out)["configuration"]


def _params() -> configuration.NodeParameters:
    return configuration.NodeParameters(
        cluster_register=configuration.NodeParametersClusterRegister(
            cluster_directory=common.ClusterDirectory(
                nodes=[
                    common.ClusterDirectoryNode(
                        public_key=bytes(range(32)),
                        addresses=[
                            common.ClusterDirectoryNodeAddress(host="10.0.0.1"),
                            common.ClusterDirectoryNodeAddress(host="node.example"),
                        ],
                    ),
                    common.ClusterDirectoryNode(
                        public_key=b"k" * 32,
                        addresses=[common.ClusterDirectoryNodeAddress(host="10.0.0.2")],
                    ),
                ]
            ),
            register_ticket=b"t" * 16,
            ca_certificate=b"c" * 60,
            owner_public_key=b"o" * 32,
        )
    )


def test_the_canonical_encoding_parses() -> None:
    params = _params()
    assert parse_strict(configuration.NodeParameters, bytes(params)) == params
    assert parse_strict(configuration.NodeParameters, b"") == configuration.NodeParameters()


def test_truncation_is_refused_where_betterproto2_takes_it() -> None:
    raw = bytes(_params())
    # The behaviour this module exists for: betterproto2 keeps a cut field.
    assert configuration.NodeParameters.parse(raw[:-1]).cluster_register is not None
    for end in range(1, len(raw)):
        with pytest.raises(ValueError):
            parse_strict(configuration.NodeParameters, raw[:end])


def test_garbage_is_refused_where_betterproto2_takes_it() -> None:
    garbage = b"hello, world\n"
    assert configuration.NodeParameters.parse(garbage) == configuration.NodeParameters()
    with pytest.raises(ValueError, match="not one of NodeParameters's"):
        parse_strict(configuration.NodeParameters, garbage)


def test_a_varint_in_a_bytes_field_allocates_nothing() -> None:
    """Field 2 of ClusterRegister (register_ticket, bytes) sent as a varint
    of 2**40: betterproto2 would make bytes(2**40) of it."""
    huge = bytes([0x10]) + bytes([0x80] * 5) + bytes([0x20])
    inner = bytes([0x12, len(huge)]) + huge
    with pytest.raises(ValueError, match="wire type 0, declared bytes"):
        parse_strict(configuration.NodeParameters, inner)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes([0x12, 0x02, 0x22, 0x00]), "field 4 is not one of"),  # unknown inside the register
        (bytes([0x0B]), "wire type 3"),  # a group start, which proto3 never writes
        (bytes([0x12, 0x00, 0x12, 0x00]), "not the canonical encoding"),  # the oneof twice
        (bytes([0x12, 0x02, 0x12, 0x00]), "not the canonical encoding"),  # an empty ticket written
        (bytes([0x12, 0xFF]), "truncated"),
        (bytes([0x12, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]), "10"),
    ],
)
def test_refused(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_strict(configuration.NodeParameters, data)


def test_invalid_utf8_in_a_string_is_refused() -> None:
    raw = bytes(common.ClusterDirectoryNodeAddress(host="ab"))
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_strict(common.ClusterDirectoryNodeAddress, raw.replace(b"ab", b"\xff\xfe"))


def test_nested_messages_of_other_packages_are_walked() -> None:
    """A Timestamp (google.protobuf) inside a SupervisedRunnable."""
    runnable = management.SupervisedRunnable(
        name="root.a",
        last_error_at=datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    )
    raw = bytes(runnable)
    assert parse_strict(management.SupervisedRunnable, raw) == runnable
    with pytest.raises(ValueError, match="last_error_at"):
        parse_strict(management.SupervisedRunnable, raw[:-1] + b"\x80")


def _google(pb: ModuleType, data: bytes) -> bytes | None:
    try:
        return bytes(pb.NodeParameters.FromString(data).SerializeToString())
    except DecodeError:
        return None


def _ours(data: bytes) -> bytes | None:
    try:
        return bytes(parse_strict(configuration.NodeParameters, data))
    except ValueError:
        return None


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32), kind=st.integers(0, 3))
def test_mutations_agree_with_google(pb: ModuleType, seed: int, kind: int) -> None:
    rng = random.Random(seed)
    data = bytearray(bytes(_params()))
    if kind == 0:
        del data[rng.randrange(len(data)) :]
    elif kind == 1:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 2:
        data[rng.randrange(len(data))] = rng.randrange(256)
    else:
        data = bytearray(rng.randbytes(rng.randrange(40)))
    ours, theirs = _ours(bytes(data)), _google(pb, bytes(data))
    if ours is not None:
        assert ours == theirs == bytes(data)
    if theirs is None:
        assert ours is None
