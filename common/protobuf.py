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

from dataclasses import dataclass
from typing import TypeVar

import betterproto2

from common.protowire import varint as _varint

__all__ = ["checked_fields", "parse_checked", "parse_strict"]

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


def checked_fields(cls: type[betterproto2.Message], data: bytes) -> dict[str, bytes | int]:
    """The checks of `parse_checked` on ``data`` as a ``cls`` message,
    without building the message: the values of its singular fields that
    are set, by name (the bytes of a length-delimited or fixed-width
    field, the number of a varint, as on the wire: no sign or zigzag
    decoding); repeated fields and maps are checked but not returned.

    For a hot path that needs a few top-level fields and would pass an
    embedded message on as its bytes: they are the sender's, checked as
    `parse_checked` checks them (so `parse_checked` of them succeeds).
    `ValueError` as `parse_checked`.
    """
    out: dict[str, bytes | int] = {}
    _walk(cls, data, cls.__name__, 0, skip_unknown=True, out=out)
    return out


_PLAIN, _STRING, _MESSAGE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Field:
    """What the walk needs of one declared field, read once per class."""

    name: str
    #: The wire type it is declared with.
    want: int
    #: At most once in a message (neither repeated nor a map).
    singular: bool
    #: Its oneof, if any.
    group: str | None
    #: May come packed (a repeated scalar).
    packable: bool
    kind: int
    #: For `_MESSAGE`: the class its payload is walked as.
    inner: type[betterproto2.Message] | None


#: Per class, its fields by number (built on first use: betterproto2's
#: metadata is read through several dictionaries per field otherwise).
_plans: dict[type[betterproto2.Message], dict[int, _Field]] = {}


def _plan(cls: type[betterproto2.Message]) -> dict[int, _Field]:
    plan = _plans.get(cls)
    if plan is None:
        # betterproto2 types this class property for concrete subclasses only.
        meta: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
        plan = {}
        for number, name in meta.field_name_by_number.items():
            field = meta.meta_by_field_name[name]
            want = _WIRE_TYPE[field.proto_type]
            inner = None
            kind = _PLAIN
            if field.proto_type == betterproto2.TYPE_STRING:
                kind = _STRING
            elif field.proto_type in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
                kind = _MESSAGE
                # A well-known type that betterproto2 unwraps (Timestamp to
                # datetime) is walked as the message it is on the wire.
                inner = field.unwrap() if field.unwrap else meta.cls_by_field[name]
            plan[number] = _Field(
                name,
                want,
                not field.repeated and field.proto_type != betterproto2.TYPE_MAP,
                field.group,
                bool(field.repeated) and want != _LEN,
                kind,
                inner,
            )
        _plans[cls] = plan
    return plan


def _walk(
    cls: type[betterproto2.Message],
    data: bytes,
    where: str,
    depth: int,
    *,
    skip_unknown: bool,
    out: dict[str, bytes | int] | None = None,
) -> None:
    """Check ``data`` against ``cls`` (see `parse_checked`); with ``out``, put
    there the value of each singular field it declares (bytes of a
    length-delimited or fixed one, the number of a varint), by name."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH}")
    plan = _plan(cls)
    seen: set[int] = set()
    oneofs: dict[str, str] = {}
    pos = 0
    size = len(data)
    while pos < size:
        # Error locations are formatted only when raised: on the way to
        # accepting a message, no string is built.
        key = data[pos]
        if key < 0x80:  # the common one-byte key, without a call
            pos += 1
        else:
            try:
                key, pos = _varint(data, pos)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        number, wire_type = key >> 3, key & 7
        if not 0 < number < 1 << 29:
            raise ValueError(f"{where}: field number {number} out of range")
        field = plan.get(number)
        if field is None:
            if not skip_unknown:
                raise ValueError(f"{where}: field {number} is not one of {cls.__name__}'s")
            pos = _skip(data, pos, wire_type, f"{where}.{number}")
            continue
        name = field.name
        if field.singular:
            if number in seen:
                raise ValueError(f"{where}.{name}, field {number}: set twice")
            seen.add(number)
        if field.group is not None:
            other = oneofs.setdefault(field.group, name)
            if other != name:
                raise ValueError(f"{where}: more than one of {field.group} set: {other}, {name}")
        want = field.want
        packed = field.packable and wire_type == _LEN
        if wire_type != want and not packed:
            raise ValueError(
                f"{where}.{name}, field {number}: wire type {wire_type}, want {_WIRE_NAMES[want]}"
            )
        start = pos
        if wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > size:
                raise ValueError(f"{where}.{name}, field {number}: past end of message")
            if out is not None and field.singular:
                out[name] = data[start:pos]
            continue
        # A varint's value or a length: mostly one byte, read without a call.
        if pos < size and data[pos] < 0x80:
            value = data[pos]
            pos += 1
        else:
            try:
                value, pos = _varint(data, pos)
            except ValueError as exc:
                raise ValueError(f"{where}.{name}, field {number}: {exc}") from None
        if wire_type == _VARINT:
            if out is not None and field.singular:
                out[name] = value
            continue
        length = value
        if pos + length > size:
            raise ValueError(
                f"{where}.{name}, field {number}: past end of message (length {length})"
            )
        payload = data[pos : pos + length]
        pos += length
        if out is not None and field.singular:
            out[name] = payload
        if packed:
            _walk_packed(want, payload, f"{where}.{name}, field {number}")
        elif field.kind == _STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}.{name}, field {number}: not UTF-8") from e
        elif field.kind == _MESSAGE:
            assert field.inner is not None
            _walk(field.inner, payload, f"{where}.{name}", depth + 1, skip_unknown=skip_unknown)


def _walk_packed(wire_type: int, payload: bytes, where: str) -> None:
    pos = 0
    while pos < len(payload):
        if wire_type == _VARINT:
            try:
                _, pos = _varint(payload, pos)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        else:
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(payload):
                raise ValueError(f"{where}: truncated")


def _skip(data: bytes, pos: int, wire_type: int, where: str) -> int:
    """The position after an unknown field's value of ``wire_type`` at ``pos``."""
    try:
        if wire_type == _VARINT:
            return _varint(data, pos)[1]
        if wire_type == _LEN:
            length, pos = _varint(data, pos)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if wire_type in (_FIXED64, _FIXED32):
        end = pos + (8 if wire_type == _FIXED64 else 4)
    elif wire_type == _LEN:
        end = pos + length
    else:
        raise ValueError(f"{where}: unsupported wire type {wire_type} (proto3 never writes it)")
    if end > len(data):
        raise ValueError(f"{where}: past end of message")
    return end
