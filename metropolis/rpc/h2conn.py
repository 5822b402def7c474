"""h2's connection with two changes of ours (see :class:`H2Connection`)."""

from __future__ import annotations

from typing import Any

import h2.connection
import h2.errors
import h2.exceptions
import h2.stream
import hyperframe.frame

__all__ = ["H2Connection"]


class H2Connection(h2.connection.H2Connection):
    """h2, refusing a stream beyond our MAX_CONCURRENT_STREAMS as a stream error.

    h2 raises :class:`h2.exceptions.TooManyStreamsError` for it, a
    connection error that ends every stream of the connection. RFC 9113
    5.1.2 allows a stream error instead, which is what Go's servers send:
    RST_STREAM REFUSED_STREAM (the caller may retry it). h2 checks the limit
    before it changes any state, so the frame can be handled here instead;
    this uses three of h2's internals (its HPACK decoder, the highest stream
    ID and the record of how closed streams closed), which
    tests/metropolis/test_rpc_bounds.py pins.

    Also h2's dispatch of a received frame (:meth:`_receive_frame`) without
    its trace call, whose argument h2 computes first: ``repr(frame)``, which
    serialises a DATA frame's payload again, for every frame received.
    tests/metropolis/test_rpc_transport.py holds the copy to h2's code.
    """

    def _receive_frame(self, frame: Any) -> Any:
        # h2 4.x's H2Connection._receive_frame, less its trace line.
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except h2.exceptions.StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = hyperframe.frame.RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except h2.exceptions.StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = hyperframe.frame.RstStreamFrame(e.stream_id)
                f.error_code = h2.errors.ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise h2.exceptions.StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events

    def _receive_headers_frame(self, frame: Any) -> Any:
        try:
            return super()._receive_headers_frame(frame)
        except h2.exceptions.TooManyStreamsError:
            sid = frame.stream_id
            if sid % 2 == 0 or sid <= self.highest_inbound_stream_id:
                raise
        # Every header block must pass through the HPACK decoder, refused or
        # not, or its dynamic table falls out of step with the peer's.
        try:
            self.decoder.decode(frame.data, raw=True)
        except Exception as e:  # hpack raises several types, as h2 knows
            raise h2.exceptions.ProtocolError(f"Error decoding header block: {e}") from e
        self.highest_inbound_stream_id = sid
        # DATA still arriving for it is then answered like that of any stream
        # we reset (its window credited, RST_STREAM STREAM_CLOSED).
        self._closed_streams[sid] = h2.stream.StreamClosedBy.SEND_RST_STREAM
        refusal = hyperframe.frame.RstStreamFrame(sid)
        refusal.error_code = h2.errors.ErrorCodes.REFUSED_STREAM
        return [refusal], []
