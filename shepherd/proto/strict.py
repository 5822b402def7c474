"""Strict parsing of the generated messages: malformed bytes fail instead of parsing.

betterproto2's parser (0.10) is lenient where bytes from a machine must not
be trusted: garbage and truncated bytes become a partly or wholly empty
message, a field of the wrong wire type is taken as it comes (a varint where
a string is declared gives an int in a str field), a oneof with both members
set keeps the last, and some malformations raise ``KeyError`` or
``EOFError``. `parse` therefore checks the bytes' framing against the
message's declared fields first, into embedded messages, and only then lets
betterproto2 build the message from them.

Refused, as `MalformedMessage`: a field number outside 1 to 2**29-1; a wire type other than the
four proto3 uses; a varint of more than 10 bytes; a length or fixed-size
value past the end; a known field of another wire type than its declared
type has (length-delimited for strings, bytes, messages and packed
scalars); a string that is not UTF-8; a singular field given twice, and a
oneof with more than one member given (protobuf lets the last win, but our
peers never write them, so they mean a broken or hostile peer). Unknown
fields of any wire type are skipped, as protobuf says: a newer peer may
send some.

This checks, it does not decode: the values are betterproto2's. It reads
the generated classes' field metadata (`betterproto2.FieldMetadata`) and
their ``_betterproto.cls_by_field`` for the class of embedded messages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar, cast

import betterproto2

from shepherd.errors import ShepherdError

M = TypeVar("M", bound=betterproto2.Message)

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_WIRE_NAMES = {_VARINT: "varint", _I64: "fixed64", _LEN: "length-delimited", _I32: "fixed32"}

_WIRE_OF_TYPE = {
    **dict.fromkeys(
        ("enum", "bool", "int32", "int64", "uint32", "uint64", "sint32", "sint64"), _VARINT
    ),
    **dict.fromkeys(("float", "fixed32", "sfixed32"), _I32),
    **dict.fromkeys(("double", "fixed64", "sfixed64"), _I64),
    **dict.fromkeys(("string", "bytes", "message"), _LEN),
}


class MalformedMessage(ShepherdError, ValueError):
    """The bytes are not a well-formed encoding of the expected message."""


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    wire_type: int
    #: Whether a length-delimited value is also acceptable (packed repeated scalars).
    packed: bool
    repeated: bool
    group: str | None
    #: The class to check a length-delimited value against, for messages.
    message: type[betterproto2.Message] | None
    string: bool


@functools.cache
def _fields(cls: type[betterproto2.Message]) -> dict[int, _Field]:
    """The declared fields of ``cls`` by number."""
    # No public way to a message field's class; generated messages are dataclasses.
    meta_of_class: Any = getattr(cls, "_betterproto")  # noqa: B009
    classes: dict[str, type[betterproto2.Message]] = meta_of_class.cls_by_field
    fields = {}
    for field in dataclasses.fields(cast(Any, cls)):
        meta = betterproto2.FieldMetadata.get(field)
        if meta.proto_type not in _WIRE_OF_TYPE or meta.unwrap is not None:
            # None of our messages has one; checking them would be code no test runs.
            raise TypeError(f"{cls.__name__}.{field.name}: maps and wrapped types unsupported")
        wire_type = _WIRE_OF_TYPE[meta.proto_type]
        fields[meta.number] = _Field(
            name=field.name,
            wire_type=wire_type,
            packed=bool(meta.repeated) and wire_type != _LEN,
            repeated=bool(meta.repeated),
            group=meta.group,
            message=classes[field.name] if meta.proto_type == "message" else None,
            string=meta.proto_type == "string",
        )
    return fields


def _varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    for end in range(pos, min(pos + 10, len(data))):
        if data[end] < 0x80:  # the last byte: no continuation bit
            value = 0
            for byte in reversed(data[pos : end + 1]):
                value = value << 7 | byte & 0x7F
            return value, end + 1
    problem = "varint longer than 10 bytes" if len(data) >= pos + 10 else "truncated varint"
    raise MalformedMessage(f"{where}: {problem}")


def check(cls: type[betterproto2.Message], data: bytes, where: str = "") -> None:
    """Raise `MalformedMessage` unless ``data`` is a well-formed ``cls`` (see the module)."""
    where = where or cls.__name__
    declared = _fields(cls)
    seen: set[int] = set()
    groups: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, where)
        number, wire_type = key >> 3, key & 7
        if not 0 < number < 2**29:
            raise MalformedMessage(f"{where}: field number {number} out of range")
        at = f"{where} field {number}"
        start = pos
        if wire_type == _VARINT:
            _, pos = _varint(data, pos, at)
        elif wire_type == _LEN:
            length, start = _varint(data, pos, at)
            pos = start + length
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
        else:
            raise MalformedMessage(f"{at}: unsupported wire type {wire_type}")
        if pos > len(data):
            raise MalformedMessage(f"{at}: past end of message")
        field = declared.get(number)
        if field is None:
            continue  # unknown: skipped
        at = f"{where}.{field.name}, field {number}"
        if wire_type != field.wire_type and not (field.packed and wire_type == _LEN):
            want = _WIRE_NAMES[field.wire_type]
            raise MalformedMessage(f"{at}: wire type {wire_type}, want {want}")
        if not field.repeated:
            if number in seen:
                raise MalformedMessage(f"{at}: set twice")
            seen.add(number)
        if field.group is not None:
            other = groups.setdefault(field.group, field.name)
            if other != field.name:
                raise MalformedMessage(
                    f"{where}: more than one of {field.group} set: {other}, {field.name}"
                )
        if field.message is not None:
            check(field.message, data[start:pos], f"{where}.{field.name}")
        elif field.string:
            try:
                data[start:pos].decode("utf-8")
            except UnicodeDecodeError:
                raise MalformedMessage(f"{at}: not UTF-8") from None
        elif field.packed and wire_type == _LEN:
            _check_packed(data[start:pos], field.wire_type, at)


def _check_packed(data: bytes, wire_type: int, where: str) -> None:
    if wire_type == _VARINT:
        pos = 0
        while pos < len(data):
            _, pos = _varint(data, pos, where)
    elif len(data) % (8 if wire_type == _I64 else 4):
        raise MalformedMessage(f"{where}: packed values do not fill the field")


def parse(cls: type[M], data: bytes) -> M:
    """``cls.parse(data)``, after `check`; `MalformedMessage` if malformed."""
    check(cls, data)
    try:
        return cls.parse(data)
    except (ValueError, EOFError, KeyError) as exc:  # what `check` lets pass should not
        raise MalformedMessage(f"{cls.__name__}: {exc}") from exc
