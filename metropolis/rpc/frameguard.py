"""Frame boundaries followed in the received bytes, ahead of h2, to bound them.

See :class:`FrameGuard`; :mod:`metropolis.rpc.transport` feeds it every
received byte before h2 sees it.
"""

from __future__ import annotations

import h2.errors

from metropolis.errors import MetropolisError

__all__ = ["FrameGuard", "FrameViolation"]


class FrameViolation(MetropolisError):
    """The peer broke a frame bound (:class:`FrameGuard`); the connection must end."""

    def __init__(self, message: str, code: h2.errors.ErrorCodes) -> None:
        super().__init__(message)
        self.code = code


_HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x1, 0x5, 0x9
_END_HEADERS = 0x4


class FrameGuard:
    """Follows frame boundaries in the received bytes, ahead of h2.

    h2 buffers a frame until it is whole and only then checks its length
    against SETTINGS_MAX_FRAME_SIZE, so a peer announcing a 16 MiB frame
    could make it hold 16 MiB; and it accepts 64 CONTINUATIONs (1 MiB) of
    one header block. This reads only the 9-byte frame headers: it refuses
    an oversized frame as soon as its header is in, bounds a header block,
    and says whether a frame (or header block, or the client preface) is
    under way, for the frame timeout. h2 still parses and checks everything.
    """

    def __init__(self, *, preface: int, max_frame: int, max_block: int) -> None:
        self._skip = preface  # bytes to pass before the first frame header
        self._header = bytearray()
        self._remaining = 0  # payload bytes of the current frame still to come
        self._block: int | None = None  # bytes of an unfinished header block
        self._max_frame = max_frame
        self._max_block = max_block

    @property
    def partial(self) -> bool:
        """Whether the peer owes the rest of something it started."""
        return bool(self._skip or self._header or self._remaining or self._block is not None)

    def feed(self, data: bytes | bytearray) -> None:
        """Account for ``data``; :class:`FrameViolation` if it breaks a bound."""
        view = memoryview(data)
        while view:
            if self._skip or self._remaining:
                take = min(len(view), self._skip or self._remaining)
                if self._skip:
                    self._skip -= take
                else:
                    self._remaining -= take
                view = view[take:]
                continue
            take = min(len(view), 9 - len(self._header))
            self._header += view[:take]
            view = view[take:]
            if len(self._header) == 9:
                self._frame_header(bytes(self._header))
                self._header.clear()

    def _frame_header(self, header: bytes) -> None:
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        if length > self._max_frame:
            raise FrameViolation(
                f"frame of {length} bytes exceeds {self._max_frame}",
                h2.errors.ErrorCodes.FRAME_SIZE_ERROR,
            )
        self._remaining = length
        if kind in (_HEADERS, _PUSH_PROMISE) or (kind == _CONTINUATION and self._block is not None):
            self._block = (self._block or 0) + length
            if self._block > self._max_block:
                raise FrameViolation(
                    f"header block exceeds {self._max_block} bytes",
                    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                )
            if flags & _END_HEADERS:
                self._block = None
