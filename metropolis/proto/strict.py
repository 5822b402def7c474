"""Parse untrusted protobuf bytes strictly: the canonical encoding of a message, or an error.

betterproto2's ``Message.parse`` takes almost anything: a field cut short
by the end of the data is kept shortened, wire types 3, 4, 6 and 7 (which
proto3 never writes) are taken as unknown fields with no value, a field
sent with another wire type than its declaration's is stored as whatever
came (an int in a string field, which then fails to serialize, and a
varint ``n`` in a ``bytes`` field becomes ``bytes(n)``: n zero bytes
allocated), and random bytes mostly parse as an empty message with unknown
fields. For data read from a file or a peer that is not good enough, so
`parse_strict` first walks the bytes against the message's declaration
(every field known, with its declared wire type, inside the data, strings
UTF-8, embedded messages likewise), and only then lets betterproto2 build
the message; and it accepts only the encoding that betterproto2 (and
Google's runtime, and Go's) writes for that message: fields in number
order, each singular field once, no default values. That is stricter than
protobuf's rules for readers, which is the point for files that our own
tools write: anything else is a file that is not what it claims to be.

The walk reads betterproto2's per-class field metadata (``_betterproto``),
which is not public API; ``tests/metropolis/test_proto_strict.py`` pins the
behaviour.
"""

from __future__ import annotations

from typing import TypeVar

import betterproto2

__all__ = ["parse_strict"]

_M = TypeVar("_M", bound=betterproto2.Message)

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5

#: The wire type each declared type is written with.
_WIRE_TYPE = {
    **dict.fromkeys(betterproto2.WIRE_VARINT_TYPES, _VARINT),
    **dict.fromkeys(betterproto2.WIRE_FIXED_64_TYPES, _FIXED64),
    **dict.fromkeys(betterproto2.WIRE_FIXED_32_TYPES, _FIXED32),
    **dict.fromkeys(betterproto2.WIRE_LEN_DELIM_TYPES, _LEN),
}

#: Nesting bound, so that crafted data cannot exhaust the stack.
_MAX_DEPTH = 32


def parse_strict(cls: type[_M], data: bytes) -> _M:
    """``data`` as a ``cls`` message, if it is exactly that message's canonical encoding.

    `ValueError` saying what is wrong otherwise (truncated, an unknown
    field, a wrong wire type, invalid UTF-8, not canonical).
    """
    _walk(cls, data, cls.__name__, 0)
    message = cls.parse(data)
    if bytes(message) != data:
        raise ValueError(
            f"{cls.__name__}: not the canonical encoding "
            "(fields out of number order, repeated, or with default values)"
        )
    return message


def _varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError(f"{where}: truncated")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= 1 << 64:
                raise ValueError(f"{where}: varint over 64 bits")
            return result, pos
    raise ValueError(f"{where}: varint longer than 10 bytes")


def _walk(cls: type[betterproto2.Message], data: bytes, where: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH}")
    # betterproto2 types this class property for concrete subclasses only.
    meta: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, where)
        number, wire_type = key >> 3, key & 7
        name = meta.field_name_by_number.get(number)
        if name is None:
            raise ValueError(f"{where}: field {number} is not one of {cls.__name__}'s")
        field = meta.meta_by_field_name[name]
        at = f"{where}.{name}"
        want = _WIRE_TYPE[field.proto_type]
        packed = bool(field.repeated) and want != _LEN and wire_type == _LEN
        if wire_type != want and not packed:
            raise ValueError(f"{at}: wire type {wire_type}, declared {field.proto_type}")
        if wire_type == _VARINT:
            _, pos = _varint(data, pos, at)
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(data):
                raise ValueError(f"{at}: truncated")
        else:
            length, pos = _varint(data, pos, at)
            if pos + length > len(data):
                raise ValueError(f"{at}: length {length} runs past the end")
            payload = data[pos : pos + length]
            pos += length
            if packed:
                _walk_packed(want, payload, at)
            elif field.proto_type == betterproto2.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{at}: not UTF-8") from e
            elif field.proto_type in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
                # A well-known type that betterproto2 unwraps (Timestamp to
                # datetime) is walked as the message it is on the wire.
                inner = field.unwrap() if field.unwrap else meta.cls_by_field[name]
                _walk(inner, payload, at, depth + 1)


def _walk_packed(wire_type: int, payload: bytes, where: str) -> None:
    pos = 0
    while pos < len(payload):
        if wire_type == _VARINT:
            _, pos = _varint(payload, pos, where)
        else:
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(payload):
                raise ValueError(f"{where}: truncated")
