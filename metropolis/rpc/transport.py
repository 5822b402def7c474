"""One HTTP/2 connection over a Trio TLS stream, shared by server and client.

The sans-IO ``h2`` library keeps the protocol state; this class moves bytes
and hands each HTTP/2 stream's events to whoever owns that stream:

- :meth:`Connection.run` is the one reader. It feeds received bytes to
  ``h2``, routes events into per-stream queues, and flushes what ``h2``
  wants to send (SETTINGS acks, PINGs, WINDOW_UPDATEs). It returns when the
  peer closes, and raises nothing for a broken connection: it records why
  (:attr:`Connection.failure`) and wakes every stream so that their owners
  fail instead of hanging.
- Writers (:meth:`open_stream`, :meth:`send`, :meth:`reset`) take one lock
  around "mutate h2 state, send its output", so frames leave in the order
  h2 produced them; a unary answer (headers, message, trailers) or request
  leaves in one write.
- Flow control is honoured both ways: :meth:`send` waits for window,
  and received DATA is acknowledged only when its owner takes it out of the
  queue (:meth:`receive`), so a slow consumer slows the peer down instead of
  growing a buffer.

Cancellation: a writer cancelled while waiting for the lock or for window
sends nothing. Once bytes go out, the send is shielded (for at most
``_SEND_TIMEOUT``), because Trio cannot un-send half a TLS record and a
torn record would break every stream on the connection; so cancelling one
call never harms the others. A peer that stops reading for that long
breaks the connection: every stream on it fails, and the client treats
that as UNAVAILABLE and reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from metropolis.errors import MetropolisError

__all__ = ["Closed", "Connection", "Data", "End", "Headers", "Reset", "StreamEvent"]

_log = logging.getLogger("metropolis.rpc.transport")

_READ_SIZE = 65536
# Larger than h2's 64 KiB default so one Watch update never waits for a
# WINDOW_UPDATE round trip; still bounded, so a stuck reader stops a sender.
_WINDOW = 1 << 20
_SEND_TIMEOUT = 10.0


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


class _FastLock:
    """``async with`` a Trio lock without a scheduling round when it is free.

    ``trio.Lock`` always yields to the scheduler on acquire; every write
    here goes on to ``send_all``, which checkpoints anyway, so taking a free
    lock at once saves one scheduler round per frame written.
    """

    def __init__(self, lock: trio.Lock) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


@dataclass
class _Outgoing:
    """What remains to be sent of one :meth:`Connection.send`."""

    headers: list[tuple[str, str]] | None
    data: memoryview
    trailers: list[tuple[str, str]] | None
    end_after_data: bool
    done: bool = False


class _Stream:
    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[tuple[StreamEvent, int]](float("inf"))


class Connection:
    """An HTTP/2 connection over ``stream`` (TLS already handshaken, ALPN h2).

    ``on_request`` is required on the server side (``client_side=False``).
    """

    def __init__(
        self,
        stream: trio.SSLStream[trio.SocketStream],
        *,
        client_side: bool,
        on_request: RequestCallback | None = None,
    ) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(client_side=client_side, header_encoding="utf-8")
        self._h2 = h2.connection.H2Connection(config)
        self._on_request = on_request
        self._lock = trio.Lock()
        self._locked = _FastLock(self._lock)
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
        self._pings: dict[bytes, trio.Event] = {}
        self._ping_counter = 0

    async def start(self) -> None:
        """Send our connection preface and SETTINGS."""
        async with self._locked:
            self._h2.initiate_connection()
            self._h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW})
            self._h2.increment_flow_control_window(_WINDOW)
            await self._flush()

    async def _flush(self) -> None:
        """Send what h2 has queued. The caller holds the lock."""
        await self._send_raw(self._h2.data_to_send())

    async def _send_control(self) -> None:
        """Send control frames h2 queued by itself (ACKs, WINDOW_UPDATE), if any.

        Without the lock unless there is something to send: this runs for
        every read and every message taken, and almost always finds nothing
        (h2 batches window updates). Draining outside the lock is safe
        because writers drain inside it right after each change, so at any
        await point h2's queue holds only control frames, whose order does
        not matter, never HEADERS (whose HPACK state would).
        """
        data = self._h2.data_to_send()
        if data:
            async with self._locked:
                await self._send_raw(data)

    async def _send_raw(self, data: bytes) -> None:
        if not data:
            return
        # Shielded: a caller cancelled in the middle of send_all would leave
        # half a TLS record behind and break the connection for every other
        # stream on it. Bounded instead, so a peer that stops reading breaks
        # only this connection.
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + _SEND_TIMEOUT
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._fail(e)
                raise StreamGone("connection broken") from e
        if scope.cancelled_caught:
            self._fail(TimeoutError(f"peer did not read for {_SEND_TIMEOUT} s"))
            raise StreamGone("connection stalled")

    def _fail(self, failure: BaseException | None) -> None:
        self.settled.set()
        if not self.closed:
            self.closed = True
            self.failure = failure
        for stream in self._streams.values():
            stream.send.send_nowait((Closed(self.failure), 0))
        self._window_changed.set()

    # --- reading ---------------------------------------------------------------

    async def run(self) -> None:
        """Read and dispatch until the connection ends (see the module docstring)."""
        try:
            while True:
                data = await self.stream.receive_some(_READ_SIZE)
                if not data:
                    break
                events = self._h2.receive_data(data)
                for event in events:
                    self._dispatch(event)
                await self._send_control()
        except (trio.BrokenResourceError, trio.ClosedResourceError, StreamGone) as e:
            self.read_failure = e
            self._fail(e)
        except h2.exceptions.ProtocolError as e:
            _log.warning("HTTP/2 protocol error from peer: %s", e)
            self.read_failure = e
            self._fail(e)
        else:
            self._fail(None)

    def _dispatch(self, event: h2.events.Event) -> None:
        match event:
            case h2.events.RequestReceived(stream_id=sid, headers=headers):
                assert self._on_request is not None, "a client received a request"
                self._streams[sid] = _Stream()
                self._on_request(sid, _header_dict(headers))
                if event.stream_ended is not None:
                    self._deliver(sid, End())
            case h2.events.ResponseReceived(stream_id=sid, headers=headers):
                self._deliver(sid, Headers(_header_dict(headers)))
            case h2.events.TrailersReceived(stream_id=sid, headers=headers):
                self._deliver(sid, Headers(_header_dict(headers), trailers=True))
            case h2.events.DataReceived(stream_id=sid, data=data):
                size = event.flow_controlled_length or 0
                if sid in self._streams:
                    self._streams[sid].send.send_nowait((Data(data), size))
                elif size:
                    self._acknowledge(sid, size)
            case h2.events.StreamEnded(stream_id=sid):
                self._deliver(sid, End())
            case h2.events.StreamReset(stream_id=sid, error_code=code):
                self._deliver(sid, Reset(int(code or 0)))
                # A writer waiting for window on this stream must wake to
                # find it gone.
                self._window_changed.set()
                self._window_changed = trio.Event()
            case h2.events.WindowUpdated() | h2.events.RemoteSettingsChanged():
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    self.settled.set()
                self._window_changed.set()
                self._window_changed = trio.Event()
            case h2.events.PingAckReceived(ping_data=data) if data in self._pings:
                self._pings.pop(data).set()
            case h2.events.ConnectionTerminated():
                # GOAWAY: no new streams; streams already running may finish.
                self.closed = True
            case _:
                pass

    def _deliver(self, sid: int | None, event: StreamEvent) -> None:
        if sid is not None and sid in self._streams:
            self._streams[sid].send.send_nowait((event, 0))

    def _acknowledge(self, sid: int, size: int) -> None:
        # A gone stream raises; h2 has credited the connection window anyway.
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.acknowledge_received_data(size, sid)

    async def receive(self, sid: int) -> StreamEvent:
        """The next event of stream ``sid``; DATA is acknowledged as it is taken."""
        event, size = await self._streams[sid].receive.receive()
        if size:
            self._acknowledge(sid, size)
            await self._send_control()
        return event

    # --- writing ---------------------------------------------------------------

    async def open_stream(self, headers: list[tuple[str, str]], body: bytes | None) -> int:
        """Client side: start a request stream, send ``body`` and end it; return its ID.

        ``body`` None leaves the stream open for :meth:`send` (client
        streaming). Headers and a body that fits the peer's window leave in
        one write. Raises :class:`StreamGone` if the connection is closed or
        breaks; a server that resets the stream before taking the whole body
        does not raise here: read its answer with :meth:`receive`.
        """
        out = _Outgoing(None, memoryview(body or b""), None, end_after_data=body is not None)
        async with self._locked:
            if self.closed:
                raise StreamGone("connection closed")
            try:
                sid = self._h2.get_next_available_stream_id()
                self._h2.send_headers(sid, headers)
            except h2.exceptions.ProtocolError as e:
                raise StreamGone("connection closed") from e
            self._streams[sid] = _Stream()
            try:
                self._queue(sid, out)
                await self._flush()
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
        out = _Outgoing(headers, memoryview(data), trailers, end_stream and trailers is None)
        await self._send_rest(sid, out)

    async def _send_rest(self, sid: int, out: _Outgoing) -> None:
        while True:
            async with self._locked:
                if self.closed and self.failure is not None:
                    raise StreamGone("connection broken")
                self._queue(sid, out)
                await self._flush()
                if out.done:
                    return
                changed = self._window_changed
            await changed.wait()

    def _queue(self, sid: int, out: _Outgoing) -> None:
        """Hand h2 as much of ``out`` as flow control allows (caller holds the lock)."""
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
        async with self._locked:
            try:
                self._h2.reset_stream(sid, code)
            except h2.exceptions.ProtocolError:
                return  # the stream or the whole connection is already closed
            with contextlib.suppress(StreamGone):
                await self._flush()

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
            async with self._locked:
                if self.closed:
                    return
                try:
                    self._h2.ping(data)
                except h2.exceptions.ProtocolError:
                    return
                try:
                    await self._flush()
                except StreamGone:
                    return
            with trio.move_on_after(answer_within):
                await answered.wait()
            if not answered.is_set():
                _log.warning("peer did not answer a PING within %s s; dropping it", answer_within)
                self._pings.pop(data, None)
                self._fail(TimeoutError(f"no PING answer within {answer_within} s"))
                await trio.aclose_forcefully(self.stream)
                return

    def forget(self, sid: int) -> None:
        """Stop routing events to ``sid`` (its owner is done with it)."""
        self._streams.pop(sid, None)

    async def aclose(self) -> None:
        """Say GOAWAY (best effort, briefly) and close the TLS stream. Shielded."""
        with trio.CancelScope(shield=True):
            if self.failure is None:
                with trio.move_on_after(1):
                    async with self._locked:
                        try:
                            self._h2.close_connection()
                            await self._flush()
                        except (StreamGone, h2.exceptions.ProtocolError):
                            pass
            self._fail(self.failure)
            await trio.aclose_forcefully(self.stream)


def _header_dict(headers: object) -> dict[str, str]:
    # header_encoding="utf-8" makes h2 hand us str pairs. Repeated metadata
    # keys keep their first value: nothing we read is multi-valued.
    out: dict[str, str] = {}
    for name, value in headers:  # type: ignore[attr-defined]
        out.setdefault(str(name), str(value))
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
