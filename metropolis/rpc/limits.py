"""What one peer may make a gRPC server hold, and for how long.

A caller needs no certificate to open a TLS connection (register and join
prove possession of a key instead), so everything below is within reach of
anyone who can reach the port, before any authentication. Each limit is
refused as a gRPC status or an HTTP/2 stream or connection error, never by
failing the server.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    """Per-connection bounds of a :class:`~metropolis.rpc.server.Server`.

    Memory one connection can pin, at most: its HTTP/2 receive window
    (:data:`~metropolis.rpc.transport.WINDOW`, DATA not yet taken by a
    handler), one partial frame (``max_frame_size``), one header block
    (``max_header_block``) and request messages being assembled
    (``max_request_buffer``).
    """

    #: Largest request message, in bytes (gRPC's default receive limit). A
    #: length prefix above it is answered RESOURCE_EXHAUSTED before any of
    #: the message is buffered.
    max_message: int = 4 * 1024 * 1024
    #: Bytes of request messages a connection's streams may hold while they
    #: are assembled; a stream waits (and flow control stops its sender)
    #: until others release theirs. At least ``max_message``.
    max_request_buffer: int = 8 * 1024 * 1024
    #: Streams open at once, advertised as SETTINGS_MAX_CONCURRENT_STREAMS;
    #: one more is refused with RST_STREAM REFUSED_STREAM.
    max_concurrent_streams: int = 100
    #: Largest frame payload accepted (SETTINGS_MAX_FRAME_SIZE, HTTP/2's
    #: default); a frame header announcing more closes the connection at once.
    max_frame_size: int = 16384
    #: Largest encoded header block (HEADERS plus CONTINUATIONs); more closes
    #: the connection. The decoded list is bounded by h2 to 64 KiB too.
    max_header_block: int = 65536
    #: Seconds a stream's request (headers through END_STREAM, unary and
    #: server-streaming calls) has to arrive whole; then DEADLINE_EXCEEDED.
    request_timeout: float = 30.0
    #: Seconds a frame (or a header block) may take to arrive once its first
    #: byte has; then the connection is closed.
    frame_timeout: float = 10.0
    #: Seconds a connection may stay without any open stream; then GOAWAY and
    #: close. PINGs do not count: a connection is for calls.
    idle_timeout: float = 300.0
    #: Seconds the TLS handshake may take.
    handshake_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_request_buffer < self.max_message:
            raise ValueError("max_request_buffer must hold at least one max_message")
        if not 16384 <= self.max_frame_size <= 16777215:
            raise ValueError("max_frame_size must be within HTTP/2's 16384..16777215")
