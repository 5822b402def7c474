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

from common.protobuf import checked_fields, parse_checked, parse_strict
from metropolis.proto import common, configuration, management
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
    with pytest.raises(ValueError, match="wire type 0, want length-delimited"):
        parse_strict(configuration.NodeParameters, inner)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes([0x12, 0x02, 0x22, 0x00]), "field 4 is not one of"),  # unknown inside the register
        (bytes([0x0B]), "wire type 3"),  # a group start, which proto3 never writes
        (bytes([0x12, 0x00, 0x12, 0x00]), "set twice"),  # the oneof twice
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


# --- parse_checked: a peer's bytes, unknown fields and any order allowed ------


def test_checked_skips_unknown_fields_and_takes_any_order() -> None:
    """What a newer peer or another runtime may write: an unknown field of
    each wire type, and the known fields out of number order."""
    params = _params()
    assert params.cluster_register is not None
    register = bytes(params.cluster_register)
    unknown = (
        bytes([0xF8, 0x07, 0x01])  # field 127 varint
        + bytes([0xF9, 0x07]) + b"8bytes!!"  # field 127 fixed64
        + bytes([0xFA, 0x07, 0x02]) + b"hi"  # field 127 length-delimited
        + bytes([0xFD, 0x07]) + b"4byt"  # field 127 fixed32
    )  # fmt: skip
    length = len(register)
    assert 128 <= length < 16384  # two bytes of varint
    data = unknown + bytes([0x12, 0x80 | length & 0x7F, length >> 7]) + register
    parsed = parse_checked(configuration.NodeParameters, data)
    assert parsed.cluster_register == params.cluster_register
    with pytest.raises(ValueError, match="field 127 is not one of"):
        parse_strict(configuration.NodeParameters, data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        # ClusterRegister.register_ticket (bytes) sent as a varint of 2**40.
        (bytes([0x12, 0x07, 0x10]) + bytes([0x80] * 5) + bytes([0x20]), "wire type 0"),
        (bytes([0x12, 0x05, 0x12, 0x09]) + b"abc", "past end of message"),  # truncated
        (bytes([0xFB, 0x07]), "wire type 3"),  # an unknown group start
        (bytes([0xFA, 0x07, 0x09, 0x00]), "past end of message"),  # an unknown field cut short
    ],
)
def test_checked_refuses_what_is_not_a_message(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_checked(configuration.NodeParameters, data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_checked_takes_any_bytes_to_a_message_or_a_valueerror(data: bytes) -> None:
    """And what it returns can be written again, no larger than it came:
    nothing in it stands for more bytes than were sent."""
    try:
        message = parse_checked(configuration.NodeParameters, data)
    except ValueError:
        return
    assert len(bytes(message)) <= len(data)


# --- checked_fields: parse_checked's checks, the fields' bytes as sent ---------


def test_checked_fields_are_the_bytes_as_sent() -> None:
    """An unknown field first, in the message and in the embedded one (an
    encoder again would write it last): the value is the sender's bytes."""
    params = _params()
    assert params.cluster_register is not None
    inner = bytes([0xF8, 0x07, 0x02]) + bytes(params.cluster_register)  # field 127 first
    assert bytes(parse_checked(configuration.NodeParametersClusterRegister, inner)) != inner
    data = bytes([0xF8, 0x07, 0x01, 0x12, 0x80 | len(inner) & 0x7F, len(inner) >> 7]) + inner
    assert checked_fields(configuration.NodeParameters, data) == {"cluster_register": inner}
    assert checked_fields(configuration.NodeParameters, b"") == {}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_checked_fields_refuse_what_parse_checked_refuses(data: bytes) -> None:
    """The same checks with the same errors; what they accept gives the
    fields the parsed message has, each parsing to the same value."""
    try:
        message = parse_checked(configuration.NodeParameters, data)
    except ValueError as exc:
        with pytest.raises(ValueError) as caught:
            checked_fields(configuration.NodeParameters, data)
        assert str(caught.value) == str(exc)
        return
    fields = checked_fields(configuration.NodeParameters, data)
    for name in ("cluster_bootstrap", "cluster_register"):
        value = getattr(message, name, None)
        if value is None:
            assert name not in fields
        else:
            raw = fields[name]
            assert isinstance(raw, bytes) and type(value).parse(raw) == value
