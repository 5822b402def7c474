"""Protobuf bytes from files and peers, parsed strictly by the generated (betterproto2) classes.

betterproto2's ``Message.parse`` takes almost anything: a field cut short
by the end of the data is kept shortened, wire types 3, 4, 6 and 7 (which
proto3 never writes) are taken as unknown fields with no value, a field
sent with another wire type than its declaration's is stored as whatever
came (an int in a string field, which then fails to serialize, and a
varint ``n`` in a ``bytes`` field becomes ``bytes(n)`` when the message is
written again: n zero bytes allocated), a oneof with both members set
keeps the last, random bytes mostly parse as an empty message with unknown
fields, and some malformations raise ``KeyError`` or ``EOFError``. Bytes
that anyone can send us (a request without credentials, an agent's body)
or that a disk can damage need better, so both functions here first walk
the bytes against the message's declaration and only then let betterproto2
build the message:

- `parse_checked`, for the wire: every known field with its declared wire
  type and inside the data, field numbers in protobuf's range, strings
  UTF-8, embedded messages likewise (bounded nesting), a singular field at
  most once and at most one member of a oneof (protobuf lets the last win;
  no runtime writes them, so they mean a broken or hostile writer).
  Unknown fields are skipped, as protobuf's rules for readers say: a newer
  peer may send some.
- `parse_strict`, for files our own tools write: the same, no unknown
  field, and only the canonical encoding (fields in number order, no
  default values: what betterproto2, Google's runtime and Go's write), so
  a file that is anything else is a file that is not what it claims to be.

Both raise ``ValueError`` saying what is wrong, and nothing else. They read
betterproto2's per-class field metadata (``_betterproto``), which is not
public API; ``tests/common/test_protobuf.py`` and the wire tests of both
halves pin the behaviour.
"""

from __future__ import annotations

from typing import TypeVar

import betterproto2

__all__ = ["parse_checked", "parse_strict"]

_M = TypeVar("_M", bound=betterproto2.Message)

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_WIRE_NAMES = {
    _VARINT: "varint",
    _FIXED64: "fixed64",
    _LEN: "length-delimited",
    _FIXED32: "fixed32",
}

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
    _walk(cls, data, cls.__name__, 0, skip_unknown=False)
    message = cls.parse(data)
    if bytes(message) != data:
        raise ValueError(
            f"{cls.__name__}: not the canonical encoding "
            "(fields out of number order, repeated, or with default values)"
        )
    return message


def parse_checked(cls: type[_M], data: bytes) -> _M:
    """``data`` as a ``cls`` message from a peer that may be newer or not ours.

    The walk of `parse_strict` without its demands on the writer: fields
    the declaration does not know are skipped (if well formed: wire types
    0, 1, 2 or 5), and field order, repeats and default values are the
    writer's business, as protobuf's rules for readers say. What it still
    refuses, with `ValueError`, is what would make betterproto2 build a
    message that is not one: data cut short, a known field with another
    wire type than declared (a varint ``n`` in a ``bytes`` field would
    become ``bytes(n)`` when the message is written again), strings that
    are not UTF-8, nesting beyond a bound. For requests and answers on the
    wire, where anyone may be the writer.
    """
    _walk(cls, data, cls.__name__, 0, skip_unknown=True)
    return cls.parse(data)


def _varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError(f"{where}: truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= 1 << 64:
                raise ValueError(f"{where}: varint over 64 bits")
            return result, pos
    raise ValueError(f"{where}: varint longer than 10 bytes")


def _walk(
    cls: type[betterproto2.Message], data: bytes, where: str, depth: int, *, skip_unknown: bool
) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH}")
    # betterproto2 types this class property for concrete subclasses only.
    meta: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
    seen: set[int] = set()
    oneofs: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, where)
        number, wire_type = key >> 3, key & 7
        if not 0 < number < 1 << 29:
            raise ValueError(f"{where}: field number {number} out of range")
        name = meta.field_name_by_number.get(number)
        if name is None:
            if not skip_unknown:
                raise ValueError(f"{where}: field {number} is not one of {cls.__name__}'s")
            pos = _skip(data, pos, wire_type, f"{where}.{number}")
            continue
        field = meta.meta_by_field_name[name]
        path = f"{where}.{name}"
        at = f"{path}, field {number}"
        if not field.repeated and field.proto_type != betterproto2.TYPE_MAP:
            if number in seen:
                raise ValueError(f"{at}: set twice")
            seen.add(number)
        if field.group is not None:
            other = oneofs.setdefault(field.group, name)
            if other != name:
                raise ValueError(f"{where}: more than one of {field.group} set: {other}, {name}")
        want = _WIRE_TYPE[field.proto_type]
        packed = bool(field.repeated) and want != _LEN and wire_type == _LEN
        if wire_type != want and not packed:
            raise ValueError(f"{at}: wire type {wire_type}, want {_WIRE_NAMES[want]}")
        if wire_type == _VARINT:
            _, pos = _varint(data, pos, at)
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(data):
                raise ValueError(f"{at}: past end of message")
        else:
            length, pos = _varint(data, pos, at)
            if pos + length > len(data):
                raise ValueError(f"{at}: past end of message (length {length})")
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
                _walk(inner, payload, path, depth + 1, skip_unknown=skip_unknown)


def _walk_packed(wire_type: int, payload: bytes, where: str) -> None:
    pos = 0
    while pos < len(payload):
        if wire_type == _VARINT:
            _, pos = _varint(payload, pos, where)
        else:
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(payload):
                raise ValueError(f"{where}: truncated")


def _skip(data: bytes, pos: int, wire_type: int, where: str) -> int:
    """The position after an unknown field's value of ``wire_type`` at ``pos``."""
    if wire_type == _VARINT:
        return _varint(data, pos, where)[1]
    if wire_type in (_FIXED64, _FIXED32):
        end = pos + (8 if wire_type == _FIXED64 else 4)
    elif wire_type == _LEN:
        length, pos = _varint(data, pos, where)
        end = pos + length
    else:
        raise ValueError(f"{where}: unsupported wire type {wire_type} (proto3 never writes it)")
    if end > len(data):
        raise ValueError(f"{where}: past end of message")
    return end
