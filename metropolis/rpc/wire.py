"""gRPC over HTTP/2 as bytes: message framing, timeouts, status trailers.

This is the part of the gRPC protocol spec (PROTOCOL-HTTP2.md) that sits on
top of HTTP/2 and that both our server and client speak:

- A request is a POST to ``/<package>.<Service>/<Method>`` with
  ``content-type: application/grpc`` and ``te: trailers``.
- Each message is a *length-prefixed message*: one byte compression flag
  (always 0 here: we never compress, and refuse compressed input), a 4-byte
  big-endian length, the protobuf bytes.
- A response is ``:status 200`` headers, messages, then trailers carrying
  ``grpc-status`` and a percent-encoded ``grpc-message``. An error without
  messages may be sent as a single *trailers-only* HEADERS frame.
- Binary metadata keys end in ``-bin`` and carry base64 (padding optional).

Pure functions and one small decoder class; no I/O.
"""

from __future__ import annotations

import base64
import struct
import urllib.parse

from common.numbers import parse_decimal
from metropolis.rpc.status import RPCError, Status

__all__ = [
    "CONTENT_TYPE",
    "MAX_MESSAGE",
    "MessageDecoder",
    "b64decode",
    "b64encode",
    "decode_grpc_message",
    "decode_timeout",
    "encode_grpc_message",
    "encode_timeout",
    "frame",
]

CONTENT_TYPE = "application/grpc"
#: Largest message accepted (gRPC's default receive limit is 4 MiB too).
MAX_MESSAGE = 4 * 1024 * 1024

_PREFIX = struct.Struct(">BI")


def frame(payload: bytes) -> bytes:
    """Return ``payload`` as one uncompressed length-prefixed message."""
    return _PREFIX.pack(0, len(payload)) + payload


class MessageDecoder:
    """Splits a stream of DATA bytes into length-prefixed messages.

    :meth:`feed` raises :class:`RPCError` (RESOURCE_EXHAUSTED for an oversized
    message, INTERNAL for a compressed one, which we never negotiated).
    """

    def __init__(self, limit: int = MAX_MESSAGE) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out: list[bytes] = []
        while len(self._buffer) >= _PREFIX.size:
            compressed, length = _PREFIX.unpack_from(self._buffer)
            if compressed:
                raise RPCError(Status.INTERNAL, "compressed message, but no encoding was agreed")
            if length > self._limit:
                raise RPCError(
                    Status.RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds {self._limit}"
                )
            end = _PREFIX.size + length
            if len(self._buffer) < end:
                break
            out.append(bytes(self._buffer[_PREFIX.size : end]))
            del self._buffer[:end]
        return out

    @property
    def pending(self) -> bool:
        """Whether a partial message is buffered (an error at end of stream)."""
        return bool(self._buffer)

    @property
    def expected(self) -> int:
        """Bytes the decoder will hold once the message it is assembling is whole.

        The whole message (prefix included) once its prefix is in, else what
        is buffered: lets a caller reserve memory before reading on.
        """
        if len(self._buffer) < _PREFIX.size:
            return len(self._buffer)
        return _PREFIX.size + int(_PREFIX.unpack_from(self._buffer)[1])


_UNITS = (("n", 1e-9), ("u", 1e-6), ("m", 1e-3), ("S", 1.0), ("M", 60.0), ("H", 3600.0))


def encode_timeout(seconds: float) -> str:
    """``grpc-timeout`` value for ``seconds``: at most 8 digits, rounded up, never 0."""
    seconds = max(seconds, 0.0)
    for unit, scale in _UNITS:
        value = -(-seconds // scale)  # ceil
        if value < 100_000_000:
            return f"{max(int(value), 1)}{unit}"
    return "99999999H"


def decode_timeout(value: str) -> float:
    """Seconds in a ``grpc-timeout`` value; :class:`ValueError` if malformed."""
    scales = dict(_UNITS)
    if not value or value[-1] not in scales:
        raise ValueError(f"bad grpc-timeout {value!r}")
    # The spec allows at most 8 digits.
    return parse_decimal(value[:-1], max_digits=8, what="grpc-timeout") * scales[value[-1]]


# gRPC percent-encodes grpc-message: bytes outside 0x20..0x7E, and '%'.
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def encode_grpc_message(message: str) -> str:
    return urllib.parse.quote(message, safe=_SAFE)


def decode_grpc_message(value: str) -> str:
    return urllib.parse.unquote(value, errors="replace")


def b64encode(data: bytes) -> str:
    """Base64 for ``-bin`` metadata (sent padded, as Go's gRPC does)."""
    return base64.b64encode(data).decode("ascii")


def b64decode(value: str) -> bytes:
    """Decode ``-bin`` metadata, padded or not; :class:`ValueError` if malformed."""
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"bad base64 metadata: {e}") from e
