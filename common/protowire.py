"""Protobuf's wire format read without a declaration (standard library only).

`wire_fields` splits one message's encoding into its fields, for a reader
that knows the few fields it wants by number and cannot import, or need not
pay for, the generated classes (`common.hwreport`, read by ``bmdb machine``
and the console). `varint` is the one varint reader of `common.protobuf`'s
checked parsing too.

Both raise ``ValueError`` saying what is wrong, and nothing else.
"""

from __future__ import annotations

__all__ = ["FIXED32", "FIXED64", "LEN", "VARINT", "varint", "wire_fields"]

#: The wire types proto3 writes.
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` in ``data`` and the position after it.

    `ValueError` if it is cut short, longer than 10 bytes or over 64 bits.
    """
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= 1 << 64:
                raise ValueError("varint over 64 bits")
            return result, pos
    raise ValueError("varint longer than 10 bytes")


def wire_fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """The fields of one message's encoding, in the order written:
    (field number, wire type, value), the value a varint's number (as on
    the wire: no sign or zigzag decoding) or the bytes of a
    length-delimited or fixed-width field. Embedded messages are not
    looked into: their bytes are a length-delimited field's value.

    `ValueError` if the bytes are not a message's encoding: data cut short,
    a field number out of range, wire types 3, 4, 6 or 7 (which proto3
    never writes), a varint over 64 bits.
    """
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    size = len(data)
    while pos < size:
        key, pos = varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if not 0 < number < 1 << 29:
            raise ValueError(f"field number {number} out of range")
        if wire_type == VARINT:
            value, pos = varint(data, pos)
            out.append((number, wire_type, value))
            continue
        if wire_type == LEN:
            try:
                length, start = varint(data, pos)
            except ValueError as exc:
                raise ValueError(f"field {number}: {exc}") from None
            pos = start + length
        elif wire_type in (FIXED64, FIXED32):
            start = pos
            pos += 8 if wire_type == FIXED64 else 4
        else:
            raise ValueError(f"field {number}: wire type {wire_type} (proto3 never writes it)")
        if pos > size:
            raise ValueError(f"field {number}: past end of message")
        out.append((number, wire_type, data[start:pos]))
    return out
