"""One HTTP/2 connection over a :class:`~metropolis.rpc.pipe.Pipe`, shared by server and client.

The sans-IO ``h2`` library keeps the protocol state; this class moves bytes
and hands each HTTP/2 stream's events to whoever owns that stream:

- :meth:`Connection.run` is the one reader. It feeds received bytes to
  ``h2``, routes events into per-stream queues, and writes what ``h2``
  wants to send (SETTINGS acks, PINGs, WINDOW_UPDATEs); beside it, the
  pipe's flusher sends what the socket could not take at once. It returns
  when the peer closes, and raises nothing for a broken connection: it
  records why (:attr:`Connection.failure`) and wakes every stream so that
  their owners fail instead of hanging.
- Writers (:meth:`open_stream`, :meth:`send`, :meth:`reset`) change h2's
  state and hand its output to the pipe with no await in between, so
  frames leave in the order h2 produced them (HPACK's state depends on
  it) without a lock; a unary answer (headers, message, trailers) or
  request leaves in one write.
- Flow control is honoured both ways: :meth:`send` waits for window,
  and received DATA is acknowledged only when its owner takes it out of the
  queue (:meth:`receive`), so a slow consumer slows the peer down instead of
  growing a buffer. A writer also waits while the pipe holds more than
  :data:`~metropolis.rpc.pipe.HIGH_WATER` bytes the peer has not read.

Bounds (:class:`~metropolis.rpc.limits.Limits`): the reader follows frame
boundaries itself (:class:`_FrameGuard`), ahead of h2, which would buffer a
frame of any announced length until it is whole. A frame header announcing
more than ``max_frame_size``, or a header block beyond ``max_header_block``,
closes the connection at once; a frame, header block or (server side) the
client preface that does not arrive whole within ``frame_timeout`` closes
it too. On the server, a connection without an open stream for
``idle_timeout`` is closed with GOAWAY, and a stream beyond
``max_concurrent_streams`` is refused with RST_STREAM REFUSED_STREAM (h2
alone would end the whole connection). Header blocks are checked and
decoded here, per stream: one that is malformed (RFC 9113 8.2) or not
UTF-8 resets that stream (PROTOCOL_ERROR) and nothing else.

Cancellation: a writer cancelled while waiting for window or a stream slot
sends nothing more; what it wrote before is sent whole (writes never wait,
so no cancellation tears a TLS record, which would break every stream on
the connection). A peer that reads nothing for the pipe's send timeout
while bytes wait for it breaks the connection: every stream on it fails,
and the client treats that as UNAVAILABLE and reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import re
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import h2.utilities
import hpack
import hyperframe.frame
import trio

from metropolis.errors import MetropolisError
from metropolis.rpc.limits import Limits
from metropolis.rpc.pipe import HIGH_WATER, Pipe

__all__ = ["Closed", "Connection", "Data", "End", "Headers", "Reset", "StreamEvent"]

_log = logging.getLogger("metropolis.rpc.transport")

#: Receive window, per stream and (plus HTTP/2's initial 64 KiB) per
#: connection. Larger than h2's 64 KiB default so one Watch update never
#: waits for a WINDOW_UPDATE round trip; still bounded, so a stuck reader
#: stops a sender, and DATA not yet taken by its owner never exceeds it.
WINDOW = 1 << 20
#: h2's bound on a decoded header list (it refuses more: a connection error).
_MAX_HEADER_LIST = h2.connection.H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE
_PREFACE = len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")


@dataclass(frozen=True)
class Headers:
    """Response headers (client side) or trailers (either side, ``trailers=True``)."""

    headers: dict[str, str]
    trailers: bool = False


@dataclass(frozen=True)
class Data:
    data: bytes


@dataclass(frozen=True)
class End:
    """The peer half-closed the stream: nothing more will arrive."""


_END = End()


@dataclass(frozen=True)
class Reset:
    """The peer reset the stream (RST_STREAM) with an HTTP/2 error code."""

    code: int


@dataclass(frozen=True)
class Closed:
    """The connection ended; ``failure`` says why, if it broke."""

    failure: BaseException | None


StreamEvent = Headers | Data | End | Reset | Closed

#: Called by the reader (server side) for every new request stream, with the
#: stream ID and its request headers. It must not block: it starts a task.
RequestCallback = Callable[[int, dict[str, str]], None]


class StreamGone(MetropolisError):
    """The stream was reset or the connection closed while we were writing to it.

    Internal: server and client turn it into their own outcome.
    """


@dataclass
class _Outgoing:
    """What remains to be sent of one :meth:`Connection.send`."""

    headers: list[tuple[str, str]] | None
    data: memoryview
    trailers: list[tuple[str, str]] | None
    end_after_data: bool
    done: bool = False


#: Writes in a row before a writer yields anyway (see Connection._paced).
_WRITES_PER_YIELD = 16
#: Events taken at once from a stream before :meth:`_Stream.get` yields anyway.
_READY_TAKES = 16


class _Stream:
    """One stream's received events, queued for the one task that reads them.

    Lighter than a memory channel (a unary call makes two streams' worth):
    :meth:`get` waits only when nothing is queued. When something is, it is
    a checkpoint without a scheduling round (cancellation is still seen),
    except every :data:`_READY_TAKES`-th time, so that a stream whose events
    keep coming still lets other tasks run and its deadline fire.
    """

    __slots__ = ("_events", "_gone", "_on_gone", "_ready_takes", "_waiter")

    def __init__(self) -> None:
        self._events: deque[tuple[StreamEvent, int]] = deque()
        self._waiter: trio.lowlevel.Task | None = None
        self._on_gone: Callable[[], None] | None = None
        self._gone = False
        self._ready_takes = 0

    def put(self, event: StreamEvent, size: int) -> None:
        self._events.append((event, size))
        if isinstance(event, Reset | Closed) and not self._gone:
            self._gone = True
            if self._on_gone is not None:
                self._on_gone()
        if self._waiter is not None:
            trio.lowlevel.reschedule(self._waiter)
            self._waiter = None

    async def get(self) -> tuple[StreamEvent, int]:
        if self._events:
            self._ready_takes += 1
            if self._ready_takes >= _READY_TAKES:
                self._ready_takes = 0
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
        else:
            self._ready_takes = 0
            if self._waiter is not None:
                raise trio.BusyResourceError("another task is reading this stream")
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        return self._events.popleft()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the stream is reset or the connection ends (maybe now)."""
        if self._gone:
            callback()
        else:
            self._on_gone = callback


class FrameViolation(MetropolisError):
    """The peer broke a frame bound (:class:`_FrameGuard`); the connection must end."""

    def __init__(self, message: str, code: h2.errors.ErrorCodes) -> None:
        super().__init__(message)
        self.code = code


_HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x1, 0x5, 0x9
_END_HEADERS = 0x4


class _FrameGuard:
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


class _HeaderEncoder(hpack.Encoder):
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
                if len(pieces) >= _HEADER_PIECES:
                    pieces.clear()  # bounded: per-call values (deadlines, proofs) come and go
                pieces[header] = piece
            block.append(piece)
        return b"".join(block)


#: Headers whose encoding a connection keeps.
_HEADER_PIECES = 512


class _HeaderDecoder(hpack.Decoder):
    """hpack's decoder, remembering the blocks that neither read nor change its dynamic table.

    Such a block (static-table indices and literals that are not indexed,
    as :class:`_HeaderEncoder` writes, and gRPC sends the same few blocks
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
            if len(self._blocks) >= _HEADER_PIECES:
                self._blocks.clear()
            self._blocks[key] = list(headers)
        return headers


class _H2Connection(h2.connection.H2Connection):
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


class Connection:
    """An HTTP/2 connection over ``pipe`` (TLS already handshaken, ALPN h2).

    ``on_request`` is required on the server side (``client_side=False``).
    ``limits`` bounds what the peer may make us hold (the module docstring
    says how); the idle timeout applies on the server side only.
    """

    def __init__(
        self,
        pipe: Pipe,
        *,
        client_side: bool,
        on_request: RequestCallback | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.pipe = pipe
        limits = limits or Limits()
        # Headers stay bytes and unchecked in h2: it would decode and check
        # them for the whole connection, raising out of receive_data on one
        # bad byte, which ends every stream (or, for a decoding error, our
        # reader). _header_dict does both per stream (see _refuse).
        # Outbound headers are ours, built correct (metadata a caller passes
        # is checked where it enters, see channel.call_metadata): h2 would
        # check and normalise each again, for every block sent.
        config = h2.config.H2Configuration(
            client_side=client_side,
            header_encoding=None,
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self._h2 = _H2Connection(config)
        self._h2.encoder = _HeaderEncoder()
        decoder = _HeaderDecoder()
        decoder.max_header_list_size = self._h2.decoder.max_header_list_size
        decoder.max_allowed_table_size = self._h2.decoder.max_allowed_table_size
        self._h2.decoder = decoder
        self._h2.local_settings = h2.settings.Settings(
            client=client_side,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: limits.max_frame_size,
            },
        )
        self._guard = _FrameGuard(
            preface=0 if client_side else _PREFACE,
            max_frame=limits.max_frame_size,
            max_block=limits.max_header_block,
        )
        self._limits = limits
        self._idle_timeout = float("inf") if client_side else limits.idle_timeout
        #: When the peer started what it still owes (see _FrameGuard.partial).
        self._partial_since: float | None = None
        #: When the last stream ended (None while a stream is open).
        self._idle_since: float | None = None
        self._watch_scope: trio.CancelScope | None = None
        self._on_request = on_request
        self._streams: dict[int, _Stream] = {}
        self._window_changed = trio.Event()
        #: Set once the connection can carry no new streams (GOAWAY, EOF, error).
        self.closed = False
        #: Why the connection broke (None if it closed cleanly or still runs).
        self.failure: BaseException | None = None
        #: Why reading broke: more telling than a write's broken pipe, since
        #: it carries the TLS alert the peer sent before closing.
        self.read_failure: BaseException | None = None
        #: Set when the peer's SETTINGS arrived, or the connection ended.
        self.settled = trio.Event()
        #: The last stream ID the peer's GOAWAY says it saw (None: no GOAWAY).
        self.goaway_last_stream: int | None = None
        self._pings: dict[bytes, trio.Event] = {}
        self._ping_counter = 0
        #: Writes since a writer last yielded (see _paced).
        self._writes = 0

    async def start(self) -> None:
        """Send our connection preface and SETTINGS."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._h2.initiate_connection()
        self._h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self._h2.increment_flow_control_window(WINDOW)
        self._commit()
        await self._paced()

    def _commit(self, *, burst: bool = True) -> None:
        """Hand what h2 has queued to the pipe, in order; never waits.

        Called right after every change to h2's state, with no await in
        between, so that frames leave in the order h2 produced them (which
        HPACK's shared state needs) without a lock. ``burst``: see
        :meth:`~metropolis.rpc.pipe.Pipe.write` (False for the reader's
        answers to control frames, so that the caller's next request after
        a PING, as Go's servers send with their answers, still goes at once).
        """
        data = self._h2.data_to_send()
        if not data:
            return
        try:
            self.pipe.write(data, burst=burst)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._fail(e)
            raise StreamGone("connection broken") from e

    async def _paced(self) -> None:
        """After a write: wait while the peer is behind; now and then, yield.

        Writes never wait for the socket; this is where a writer does, if
        much is buffered (:data:`~metropolis.rpc.pipe.HIGH_WATER`).
        Otherwise every :data:`_WRITES_PER_YIELD`-th write yields, so that
        a stream's messages are gathered into few socket writes while other
        tasks still run between them. The yield is shielded from
        cancellation: what was written is gone, and the caller must not
        take a cancellation for a failure to send.
        """
        if self.pipe.buffered > HIGH_WATER:
            try:
                await self.pipe.drained()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._fail(e)
                raise StreamGone("connection broken") from e
            return
        self._writes += 1
        if self._writes >= _WRITES_PER_YIELD:
            self._writes = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _fail(self, failure: BaseException | None) -> None:
        self.settled.set()
        if not self.closed:
            self.closed = True
            self.failure = failure
        for sid in list(self._streams):
            self._deliver(sid, Closed(self.failure))
        self._window_changed.set()

    # --- reading ---------------------------------------------------------------

    async def run(self) -> None:
        """Read and dispatch until the connection ends (see the module docstring).

        Also sends what writers left for the socket to take later. Never
        raises for anything the peer sends: a protocol error, a broken
        bound or a stalled frame end the connection (recorded in
        :attr:`failure`), an idle timeout ends it cleanly. Cancellation
        propagates.
        """
        now = trio.current_time()
        self._idle_since = now
        if self._guard.partial:
            self._partial_since = now
        try:
            # The reader's exception is carried out of the nursery by hand: a
            # nursery would wrap it in an ExceptionGroup.
            error: Exception | None = None
            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as reader:
                    nursery.start_soon(self._watchdog, reader)
                    nursery.start_soon(self._flusher, reader)
                    try:
                        await self._read()
                    except Exception as e:
                        error = e
                nursery.cancel_scope.cancel()
            if error is not None:
                raise error
        except (trio.BrokenResourceError, trio.ClosedResourceError, StreamGone) as e:
            self.read_failure = e
            self._fail(e)
        except (h2.exceptions.ProtocolError, FrameViolation) as e:
            _log.warning("HTTP/2 protocol error from peer: %s", e)
            if isinstance(e, FrameViolation):
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self._h2.close_connection(e.code)
            self.read_failure = e
            await self._say_goodbye()
            self._fail(e)
        except Exception as e:
            # A bug of ours or h2's, triggered by what this peer sent: it
            # ends this connection, not the server.
            _log.warning("HTTP/2 connection failed: %r", e)
            _log.debug("HTTP/2 connection failure", exc_info=True)
            self.read_failure = e
            self._fail(e)
        else:
            self._fail(self.failure)

    async def _flusher(self, reader: trio.CancelScope) -> None:
        """Send what the socket could not take at once; stop the reader if sending fails."""
        try:
            await self.pipe.run_flusher()
        except (trio.BrokenResourceError, trio.ClosedResourceError, TimeoutError) as e:
            if isinstance(e, TimeoutError):
                _log.warning("peer stopped reading: %s; closing the connection", e)
            self._fail(e)
            reader.cancel()

    async def _read(self) -> None:
        while True:
            data = await self.pipe.receive_some()
            if not data:
                return
            self.pipe.new_round()
            self._guard.feed(data)
            if not self._guard.partial:
                self._partial_since = None
            elif self._partial_since is None:
                self._partial_since = trio.current_time()
                if self._watch_scope is not None:
                    self._watch_scope.deadline = min(
                        self._watch_scope.deadline, self._partial_since + self._limits.frame_timeout
                    )
            events = self._h2.receive_data(data)
            for event in events:
                self._dispatch(event)
            # ACKs, WINDOW_UPDATEs, RST_STREAMs of refused streams.
            self._commit(burst=False)

    async def _watchdog(self, reader: trio.CancelScope) -> None:
        """Stop the reader (``reader``) when a frame stalls or the connection idles.

        One scope for the connection's life rather than one per read (each
        costs microseconds, and a unary call takes several reads): the
        watchdog wakes at least once per idle timeout to look, so that a
        stream ending need not move its deadline; a frame starting, which
        has a shorter timeout, does (see :meth:`_read`).
        """
        frame_timeout = self._limits.frame_timeout
        while True:
            deadline = (self._idle_since or trio.current_time()) + self._idle_timeout
            if self._partial_since is not None:
                deadline = min(deadline, self._partial_since + frame_timeout)
            with trio.CancelScope(deadline=deadline) as self._watch_scope:
                await trio.sleep_forever()
            now = trio.current_time()
            if self._partial_since is not None and now >= self._partial_since + frame_timeout:
                _log.warning(
                    "peer left a frame unfinished for %s s; closing the connection", frame_timeout
                )
                self.failure = TimeoutError(f"frame not finished within {frame_timeout} s")
                reader.cancel()
                return
            if self._idle_since is not None and now >= self._idle_since + self._idle_timeout:
                _log.debug("connection idle for %s s; closing it", self._idle_timeout)
                reader.cancel()  # a clean end: aclose() says GOAWAY
                return

    async def _say_goodbye(self) -> None:
        """Send the GOAWAY h2 queued for a protocol error, briefly, best effort."""
        with contextlib.suppress(StreamGone):
            self._commit()
        with (
            trio.move_on_after(1),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, TimeoutError),
        ):
            await self.pipe.flush()

    def _dispatch(self, event: h2.events.Event) -> None:
        match event:
            case h2.events.RequestReceived(stream_id=sid, headers=raw):
                assert self._on_request is not None, "a client received a request"
                headers = _header_dict(raw, _REQUEST)
                if sid is None or headers is None:
                    self._refuse(sid, "malformed request headers")
                    return
                self._streams[sid] = _Stream()
                self._idle_since = None
                self._on_request(sid, headers)
                if event.stream_ended is not None:
                    self._deliver(sid, _END)
            case (
                h2.events.ResponseReceived(stream_id=sid, headers=raw)
                | h2.events.TrailersReceived(stream_id=sid, headers=raw)
            ):
                trailers = isinstance(event, h2.events.TrailersReceived)
                headers = _header_dict(raw, _flags(self._h2.config.client_side, trailers))
                if headers is None:
                    self._refuse(sid, "malformed response headers")
                    self._deliver(sid, Reset(h2.errors.ErrorCodes.PROTOCOL_ERROR))
                    return
                self._deliver(sid, Headers(headers, trailers=trailers))
            case h2.events.DataReceived(stream_id=sid, data=data):
                size = event.flow_controlled_length or 0
                if sid in self._streams:
                    self._deliver(sid, Data(data), size)
                elif size:
                    self._acknowledge(sid, size)
            case h2.events.StreamEnded(stream_id=sid):
                self._deliver(sid, _END)
                self._wake_writers()
            case h2.events.StreamReset(stream_id=sid, error_code=code):
                self._deliver(sid, Reset(int(code or 0)))
                # A writer waiting for window on this stream must wake to
                # find it gone.
                self._wake_writers()
            case h2.events.WindowUpdated() | h2.events.RemoteSettingsChanged():
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    self.settled.set()
                self._wake_writers()
            case h2.events.PingAckReceived(ping_data=data) if data in self._pings:
                self._pings.pop(data).set()
            case h2.events.ConnectionTerminated(last_stream_id=last):
                # GOAWAY: no new streams; streams already running may finish.
                self.closed = True
                self.goaway_last_stream = last
                self._wake_writers()
            case _:
                pass

    def _refuse(self, sid: int | None, why: str) -> None:
        """Reset one stream for malformed headers (RFC 9113 8.1.1: a stream error).

        The RST_STREAM leaves with the next flush of control frames.
        """
        _log.info("resetting stream %s: %s", sid, why)
        if sid is not None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)

    def _wake_writers(self) -> None:
        """Wake writers waiting for window or a stream slot: something changed."""
        self._window_changed.set()
        self._window_changed = trio.Event()

    def _deliver(self, sid: int | None, event: StreamEvent, size: int = 0) -> None:
        stream = self._streams.get(sid) if sid is not None else None
        if stream is not None:
            stream.put(event, size)

    def _acknowledge(self, sid: int, size: int) -> None:
        # A gone stream raises; h2 has credited the connection window anyway.
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.acknowledge_received_data(size, sid)

    async def receive(self, sid: int) -> StreamEvent:
        """The next event of stream ``sid``; DATA is acknowledged as it is taken.

        A checkpoint; it waits only if no event has arrived. One task at a
        time may receive from a stream.
        """
        event, size = await self._streams[sid].get()
        if size:
            self._acknowledge(sid, size)
            with contextlib.suppress(StreamGone):
                self._commit()
        return event

    def on_gone(self, sid: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (at once, or from the reader) when stream ``sid``
        is reset by the peer or the connection ends.

        For an owner that does not read the stream's events any more but
        must know that its peer left (a server's handler, once the request
        is in). Events already received count too.
        """
        self._streams[sid].watch(callback)

    # --- writing ---------------------------------------------------------------

    async def open_stream(self, headers: list[tuple[str, str]], body: bytes | None) -> int:
        """Client side: start a request stream, send ``body`` and end it; return its ID.

        ``body`` None leaves the stream open for :meth:`send` (client
        streaming). Waits while the peer's MAX_CONCURRENT_STREAMS of our
        streams are open. Headers and a body that fits the peer's window
        leave in one write. Raises :class:`StreamGone` if the connection is closed or
        breaks; a server that resets the stream before taking the whole body
        does not raise here: read its answer with :meth:`receive`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        out = _Outgoing(None, memoryview(body or b""), None, end_after_data=body is not None)
        while True:
            # At the peer's MAX_CONCURRENT_STREAMS, wait for one of ours to
            # end rather than have h2 refuse (or the server reset) the stream.
            if self.closed:
                raise StreamGone("connection closed")
            if self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams:
                break
            await self._window_changed.wait()
        try:
            sid = self._h2.get_next_available_stream_id()
            self._h2.send_headers(sid, headers)
        except h2.exceptions.ProtocolError as e:
            raise StreamGone("connection closed") from e
        self._streams[sid] = _Stream()
        try:
            self._queue(sid, out)
            self._commit()
            await self._paced()
        except BaseException:
            self.forget(sid)
            raise
        if not out.done:
            try:
                await self._send_rest(sid, out)
            except StreamGone:
                if self.closed:
                    self.forget(sid)
                    raise
                # The peer ended the stream before taking the whole body: it
                # answered early (refused, unknown method), and that answer
                # waits in the stream's events.
            except BaseException:
                self.forget(sid)
                raise
        return sid

    async def send(
        self,
        sid: int,
        *,
        headers: list[tuple[str, str]] | None = None,
        data: bytes = b"",
        trailers: list[tuple[str, str]] | None = None,
        end_stream: bool = False,
    ) -> None:
        """Send headers, then data, then trailers on stream ``sid``, each if given.

        The stream ends after the trailers, or after the data when
        ``end_stream`` and there are no trailers. Everything leaves in one
        write unless flow control makes us wait for window in between;
        raises :class:`StreamGone` if the stream or connection is gone.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        out = _Outgoing(headers, memoryview(data), trailers, end_stream and trailers is None)
        await self._send_rest(sid, out)

    async def _send_rest(self, sid: int, out: _Outgoing) -> None:
        while True:
            if self.closed and self.failure is not None:
                raise StreamGone("connection broken")
            self._queue(sid, out)
            self._commit()
            if out.done:
                await self._paced()
                return
            changed = self._window_changed
            await changed.wait()

    def _queue(self, sid: int, out: _Outgoing) -> None:
        """Hand h2 as much of ``out`` as flow control allows."""
        try:
            if out.headers is not None:
                last = out.end_after_data and not out.data
                self._h2.send_headers(sid, out.headers, end_stream=last)
                out.headers = None
                if last:
                    out.end_after_data = False
            while out.data:
                window = self._h2.local_flow_control_window(sid)
                size = min(window, self._h2.max_outbound_frame_size, len(out.data))
                if size <= 0:
                    return
                whole = size == len(out.data)
                self._h2.send_data(
                    sid, bytes(out.data[:size]), end_stream=out.end_after_data and whole
                )
                out.data = out.data[size:]
                if whole:
                    out.end_after_data = False
            if out.trailers is not None:
                self._h2.send_headers(sid, out.trailers, end_stream=True)
                out.trailers = None
            elif out.end_after_data:
                self._h2.end_stream(sid)
                out.end_after_data = False
            out.done = True
        except h2.exceptions.ProtocolError as e:
            raise StreamGone(f"stream {sid} closed") from e

    async def reset(self, sid: int, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        """Reset stream ``sid`` if it is still open; never raises for a gone stream."""
        try:
            self._h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            await trio.lowlevel.checkpoint()
            return  # the stream or the whole connection is already closed
        with contextlib.suppress(StreamGone):
            self._commit()
            await self._paced()

    async def keepalive(self, interval: float, answer_within: float) -> None:
        """PING the peer every ``interval`` s; break the connection if an answer
        takes longer than ``answer_within`` s. Returns when the connection ends.

        A peer that vanished without closing (power loss, partition) leaves
        TCP silent for many minutes; this bounds how long calls and streams
        wait on it.
        """
        while not self.closed:
            await trio.sleep(interval)
            self._ping_counter += 1
            data = self._ping_counter.to_bytes(8, "big")
            answered = self._pings[data] = trio.Event()
            if self.closed:
                return
            try:
                self._h2.ping(data)
                self._commit()
            except (h2.exceptions.ProtocolError, StreamGone):
                return
            with trio.move_on_after(answer_within):
                await answered.wait()
            if not answered.is_set():
                _log.warning("peer did not answer a PING within %s s; dropping it", answer_within)
                self._pings.pop(data, None)
                self._fail(TimeoutError(f"no PING answer within {answer_within} s"))
                await self.pipe.aclose()
                return

    def forget(self, sid: int) -> None:
        """Stop routing events to ``sid`` (its owner is done with it).

        The last stream gone starts the idle timeout.
        """
        if self._streams.pop(sid, None) is None:
            return
        # A stream slot may be free now (see open_stream).
        self._wake_writers()
        if not self._streams:
            self._idle_since = trio.current_time()

    async def aclose(self) -> None:
        """Say GOAWAY (best effort, briefly) and close the connection. Shielded."""
        with trio.CancelScope(shield=True):
            if self.failure is None:
                with trio.move_on_after(1):
                    try:
                        self._h2.close_connection()
                        self._commit()
                        await self.pipe.flush()
                    except (
                        StreamGone,
                        h2.exceptions.ProtocolError,
                        trio.BrokenResourceError,
                        trio.ClosedResourceError,
                        TimeoutError,
                    ):
                        pass
            self._fail(self.failure)
            await self.pipe.aclose()


def _flags(client_side: bool, trailers: bool) -> h2.utilities.HeaderValidationFlags:
    return h2.utilities.HeaderValidationFlags(
        is_client=client_side,
        is_trailer=trailers,
        is_response_header=client_side and not trailers,
        is_push_promise=False,
    )


_REQUEST = _flags(False, False)


def _header_dict(
    headers: list[tuple[bytes, bytes]], flags: h2.utilities.HeaderValidationFlags
) -> dict[str, str] | None:
    """One header block, checked as h2 would (RFC 9113 8.2) and decoded as UTF-8.

    None if it is malformed: a stream error, not the connection's. gRPC
    metadata is ASCII; UTF-8 is what h2 decoded for us before. Repeated
    metadata keys keep their first value: nothing we read is multi-valued.
    """
    quick = _plain_header_dict(headers, flags)
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


def _plain_header_dict(
    headers: list[tuple[bytes, bytes]], flags: h2.utilities.HeaderValidationFlags
) -> dict[str, str] | object | None:
    """:func:`_header_dict` in one pass, for the blocks gRPC peers send.

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
                if len(fields) >= _HEADER_PIECES:
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


def peer_refused_certificate(failure: BaseException | None) -> str | None:
    """If ``failure`` is the server refusing our client certificate, say why.

    In TLS 1.3 the client finishes its handshake before the server has
    checked the client certificate, so a refusal arrives as an alert on the
    first read; ``ssl`` reports it as an ``SSLError`` whose reason names the
    alert (``TLSV1_ALERT_UNKNOWN_CA``, ``SSLV3_ALERT_CERTIFICATE_EXPIRED``…).
    """
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        if isinstance(failure, ssl.SSLError):
            reason = failure.reason or ""
            if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
                return reason
            return None
        failure = failure.__cause__ or failure.__context__
    return None
