"""Header blocks: encoded and decoded once per distinct block, checked in one pass.

gRPC sends the same few header blocks on every call; HPACK through hpack's
own encoder and decoder, and h2's generator-based check (RFC 9113 8.2),
cost a tenth of a unary call's CPU at each end. :class:`HeaderEncoder` and
:class:`HeaderDecoder` keep each distinct block's bytes or headers (bounded
by :data:`HEADER_PIECES`, per connection); :func:`header_dict` checks a
block as h2 would and decodes it, in one pass for the blocks gRPC peers
send (:func:`plain_header_dict`) and through h2's own check otherwise.
"""

from __future__ import annotations

import re
from typing import Any, cast

import h2.exceptions
import h2.utilities
import hpack

__all__ = [
    "HEADER_PIECES",
    "REQUEST_FLAGS",
    "HeaderDecoder",
    "HeaderEncoder",
    "header_dict",
    "plain_header_dict",
    "validation_flags",
]


class HeaderEncoder(hpack.Encoder):
    """HPACK without the dynamic table, so that each header's bytes are computed once.

    hpack's encoder searches and updates its table for every header of
    every block (a tenth of a unary call's CPU, both ends). Encoding every
    header as a literal that is never indexed (or as its static-table
    index) makes its bytes a function of the header alone, cached here:
    a block is a join of cached pieces. Literals are not Huffman-coded,
    which also spares the peer's decoder. The table size updates h2 asks
    for are still sent (hpack's own code).
    """

    def __init__(self) -> None:
        super().__init__()
        self._pieces: dict[tuple[str, str], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        pieces = self._pieces
        block = []
        if self.header_table.resized:
            block.append(self._encode_table_size_change())
            self.header_table.resized = False
        for header in headers:
            piece = pieces.get(header)
            if piece is None:
                name, value = (h if isinstance(h, bytes) else h.encode() for h in header)
                piece = self.add((name, value), sensitive=True, huffman=False)
                if len(pieces) >= HEADER_PIECES:
                    pieces.clear()  # bounded: per-call values (deadlines, proofs) come and go
                pieces[header] = piece
            block.append(piece)
        return b"".join(block)


#: Headers whose encoding a connection keeps.
HEADER_PIECES = 512


class HeaderDecoder(hpack.Decoder):
    """hpack's decoder, remembering the blocks that neither read nor change its dynamic table.

    Such a block (static-table indices and literals that are not indexed,
    as :class:`HeaderEncoder` writes, and gRPC sends the same few blocks
    on every call) decodes to the same headers whenever the table is
    empty and its size limit the same, and leaves it so: those blocks are
    decoded once. Anything else (a peer that indexes, as Go's and grpcio's
    encoders do; a table size update) is decoded every time, by hpack.
    """

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[tuple[int, bytes], list[tuple[bytes, bytes]]] = {}

    def decode(self, data: bytes, raw: bool = False) -> Any:
        table = self.header_table
        pristine = raw and not table.dynamic_entries and not (data[:1] and data[0] & 0xE0 == 0x20)
        key = (table.maxsize, data)
        if pristine:
            known = self._blocks.get(key)
            if known is not None:
                return list(known)
        headers = super().decode(data, raw)
        if pristine and not table.dynamic_entries:
            if len(self._blocks) >= HEADER_PIECES:
                self._blocks.clear()
            self._blocks[key] = list(headers)
        return headers


def validation_flags(client_side: bool, trailers: bool) -> h2.utilities.HeaderValidationFlags:
    return h2.utilities.HeaderValidationFlags(
        is_client=client_side,
        is_trailer=trailers,
        is_response_header=client_side and not trailers,
        is_push_promise=False,
    )


REQUEST_FLAGS = validation_flags(False, False)


def header_dict(
    headers: list[tuple[bytes, bytes]], flags: h2.utilities.HeaderValidationFlags
) -> dict[str, str] | None:
    """One header block, checked as h2 would (RFC 9113 8.2) and decoded as UTF-8.

    None if it is malformed: a stream error, not the connection's. gRPC
    metadata is ASCII; UTF-8 is what h2 decoded for us before. Repeated
    metadata keys keep their first value: nothing we read is multi-valued.
    """
    quick = plain_header_dict(headers, flags)
    if quick is not _UNSURE:
        return cast("dict[str, str] | None", quick)
    out: dict[str, str] = {}
    try:
        for name, value in h2.utilities.validate_headers(headers, flags):
            out.setdefault(name.decode(), value.decode())
    except (h2.exceptions.ProtocolError, UnicodeDecodeError):
        return None
    return out


_UNSURE = object()
#: Characters of a field name (RFC 9113 8.2.1: no controls, space, upper case or colon).
_NAME = re.compile(rb"[\x21-\x39\x3b-\x40\x5b-\x7e]+")
#: A field value: no NUL, CR or LF, no space or tab at either end.
_VALUE = re.compile(rb"(?:[^\x00\n\r \t](?:[^\x00\n\r]*[^\x00\n\r \t])?)?")
#: The pseudo-header fields of a plain request, of a response, of trailers.
_PSEUDO_REQUEST = frozenset([b":method", b":scheme", b":path", b":authority"])
_PSEUDO_RESPONSE = frozenset([b":status"])
_PSEUDO_NONE: frozenset[bytes] = frozenset()
#: Fields whose rules h2's own check applies (host against :authority).
_SPECIAL = h2.utilities.CONNECTION_HEADERS | {b"host"}
#: Regular fields that passed the checks, decoded (the same few come with every call).
_FIELDS: dict[tuple[bytes, bytes], tuple[str, str]] = {}


def plain_header_dict(
    headers: list[tuple[bytes, bytes]], flags: h2.utilities.HeaderValidationFlags
) -> dict[str, str] | object | None:
    """:func:`header_dict` in one pass, for the blocks gRPC peers send.

    Accepts only blocks that h2's check (``validate_headers``) accepts:
    exactly the pseudo-header fields of a plain request (or of a response,
    or none in trailers), first and once each, a non-empty ``:path`` and no
    CONNECT; field names and values within RFC 9113 8.2.1; ``te`` only as
    ``trailers``; no ``host`` or connection-specific field. Anything else
    is :data:`_UNSURE`, for h2's check to decide: its generators cost
    several times this pass, on every block.
    """
    if flags.is_trailer:
        pseudo = _PSEUDO_NONE
    elif flags.is_response_header:
        pseudo = _PSEUDO_RESPONSE
    else:
        pseudo = _PSEUDO_REQUEST
    out: dict[str, str] = {}
    seen = 0
    regular = False
    fields = _FIELDS
    try:
        for header in headers:
            name, value = header
            if name[:1] == b":":
                key = name.decode()
                if regular or name not in pseudo or key in out or not _VALUE.fullmatch(value):
                    return _UNSURE
                seen += 1
                out[key] = value.decode()
                continue
            field = fields.get(header)
            if field is None:
                if not _VALUE.fullmatch(value) or not _NAME.fullmatch(name) or name in _SPECIAL:
                    return _UNSURE
                if name == b"te" and value.lower() != b"trailers":
                    return _UNSURE
                field = (name.decode(), value.decode())
                if len(fields) >= HEADER_PIECES:
                    fields.clear()
                fields[header] = field
            regular = True
            out.setdefault(*field)
    except UnicodeDecodeError:
        return None  # well-formed, as h2 would find, but not UTF-8
    if seen != len(pseudo):
        return _UNSURE
    if pseudo is _PSEUDO_REQUEST and (out[":method"] == "CONNECT" or not out[":path"]):
        return _UNSURE
    return out
