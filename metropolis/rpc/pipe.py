"""One connection's bytes, in TLS or not: writes that never wait, reads that wait only for the peer.

:class:`~metropolis.rpc.transport.Connection` produces its output
synchronously (the sans-IO ``h2`` hands back bytes); this is where those
bytes meet the socket, at the lowest cost per message that Trio allows:

- :meth:`Pipe.write` is synchronous: TLS encrypts into a memory BIO
  (``ssl.SSLObject``, no ``trio.SSLStream``), and the ciphertext goes to the
  socket at once with a non-blocking ``send``; what the socket does not take
  waits in a buffer that :meth:`Pipe.flush` sends, in order, as the socket
  becomes writable. A writer therefore never holds a lock, nothing it
  wrote is ever torn by its cancellation, and bytes leave in the order they
  were written. :attr:`Pipe.buffered` lets writers apply back-pressure
  (:meth:`Pipe.drained`).
- :meth:`Pipe.receive_some` reads what the socket has, decrypting; it waits
  only when there is nothing to read.

``trio.SSLStream`` over ``trio.SocketStream`` costs two or three
scheduling rounds and a lock per write or read (each socket operation is a
checkpoint, and the TLS layer serialises its callers); a unary call made
about a dozen of them. Here a read costs one round, a write none. A stream
that is not a ``trio.SocketStream`` (a test's memory stream) works too:
its writes are buffered and sent by :meth:`flush` with ``send_all``.

Only one task may call :meth:`receive_some` at a time (the connection's
reader); any number may call :meth:`write`. Errors: a broken or closed
connection is :class:`PipeBroken` (or :class:`PipeClosed`), which are
``trio.BrokenResourceError`` (and ``ClosedResourceError``), from any
method, the TLS error that caused it as its ``__cause__``; a peer that
has read nothing for ``send_timeout`` seconds while bytes wait for it is
:class:`TimeoutError` from :meth:`flush` (and the pipe is broken after).
"""

from __future__ import annotations

import contextlib
import os
import ssl

import trio

from metropolis.errors import MetropolisError

__all__ = ["Pipe", "PipeBroken", "PipeClosed"]


class PipeBroken(MetropolisError, trio.BrokenResourceError):
    """The connection broke (the cause is the TLS or socket error); Trio's
    ``BrokenResourceError``, as a stream's callers expect."""


class PipeClosed(MetropolisError, trio.ClosedResourceError):
    """The pipe was closed (by :meth:`Pipe.aclose`, or its socket behind its back);
    Trio's ``ClosedResourceError``."""


_READ_SIZE = 65536
#: Back-pressure: writers wait while more than this waits for the socket.
HIGH_WATER = 256 * 1024


class Pipe:
    """A connected byte stream with synchronous writes; see the module docstring.

    ``context``: TLS over the stream, client side with ``server_hostname``
    or server side (:meth:`handshake` must be awaited first); None: the
    bytes go as they are. ``ragged_eof_ok``: a peer closing TCP without TLS's
    close_notify is a clean end (a server's view, as ``https_compatible``),
    not an error.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        context: ssl.SSLContext | None = None,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
        ragged_eof_ok: bool = False,
        send_timeout: float = 10.0,
    ) -> None:
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._fd = -1 if self._socket is None else self._socket.fileno()
        self._tls: ssl.SSLObject | None = None
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        if context is not None:
            self._tls = context.wrap_bio(
                self._in, self._out, server_side=server_side, server_hostname=server_hostname
            )
        self._ragged_eof_ok = ragged_eof_ok
        self._send_timeout = send_timeout
        #: Bytes written and not yet taken by the socket, in order.
        self._buffer = bytearray()
        #: With TLS: what writes gathered, to be encrypted after the buffer.
        self._plain: list[bytes] = []
        self._plain_size = 0
        #: Writes since the last read or flush (see new_round).
        self._burst = 0
        #: Whether a task is sending the buffer (only one may wait for the socket).
        self._sending = False
        #: Tasks waiting for the buffer to shrink (or the pipe to break).
        self._progress = trio.lowlevel.ParkingLot()
        #: The flusher, parked until there is something to send.
        self._idle_flusher: trio.lowlevel.Task | None = None
        self._broken: BaseException | None = None
        self._closed = False

    # --- TLS -------------------------------------------------------------------

    async def handshake(self) -> None:
        """Run the TLS handshake (nothing without TLS).

        A refusal (the peer's certificate, or ours) is sent to the peer as
        its alert, then raised as ``trio.BrokenResourceError`` with the
        ``ssl.SSLError`` as its cause. Cancellation leaves the pipe unusable.
        """
        if self._tls is None:
            return
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._take_ciphertext()
                await self.flush()
                data = await self._receive_raw()
                if not data:
                    self._in.write_eof()
                else:
                    self._in.write(data)
            except ssl.SSLError as e:
                # OpenSSL wrote the alert saying why (unknown CA, expired
                # certificate); without it the peer sees a bare EOF and
                # cannot tell a refusal from a crash.
                self._take_ciphertext()
                with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError):
                    await self.flush()
                self._break(e)
                raise PipeBroken(f"TLS handshake failed: {e}") from e
        self._take_ciphertext()
        await self.flush()

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        """The peer's certificate, DER (after the handshake; None without TLS or certificate)."""
        if self._tls is None:
            return None
        der = self._tls.getpeercert(binary_form=True)
        return der if isinstance(der, bytes) else None

    def selected_alpn_protocol(self) -> str | None:
        return None if self._tls is None else self._tls.selected_alpn_protocol()

    def _take_ciphertext(self) -> None:
        """Move what TLS produced into the send buffer (or the socket)."""
        data = self._out.read()
        if data:
            self._send_now(data)

    # --- writing ---------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes written that the socket has not taken yet."""
        return len(self._buffer) + self._plain_size

    def write(self, data: bytes, *, burst: bool = True) -> None:
        """Send ``data`` after everything written before; never waits.

        The first write of a burst goes to the socket at once; later ones
        wait for the flusher, which runs when the writer yields, so that a
        stream's messages written in a row leave in one TLS record and one
        ``send`` (see :meth:`new_round`). ``burst`` False: a write that
        neither waits for a burst nor starts one (an answer to the peer's
        control frames, written as they are read). Raises
        ``trio.BrokenResourceError`` if the pipe is broken (or
        ``ClosedResourceError`` if closed).
        """
        self._check()
        if (self._burst and burst) or self._buffer or self._plain:
            self._burst += 1
            if self._tls is not None:
                self._plain.append(data)
                self._plain_size += len(data)
            else:
                self._buffer += data
            self._wake_flusher()
            return
        if burst:
            self._burst = 1
        if self._tls is not None:
            self._encrypt(data)
            data = self._out.read()
        self._send_now(data)

    def new_round(self) -> None:
        """Say that the peer answered: the next write starts a burst (goes at once).

        The connection's reader calls this for every read: in a
        request-answer exchange every write then leaves at once, while a
        stream's messages written without a read in between are gathered.
        """
        self._burst = 0

    def _encrypt(self, data: bytes) -> None:
        assert self._tls is not None
        try:
            self._tls.write(data)
        except ssl.SSLError as e:
            self._break(e)
            raise PipeBroken(f"TLS failed: {e}") from e

    def _gather(self) -> None:
        """Encrypt what writes gathered, into the send buffer."""
        if self._plain:
            data = b"".join(self._plain)
            self._plain.clear()
            self._plain_size = 0
            self._encrypt(data)
            self._take_ciphertext()
            self._progress.unpark_all()  # what is buffered shrank, or stayed
        else:
            self._take_ciphertext()

    def _send_now(self, data: bytes) -> None:
        if not self._buffer and self._fd >= 0:
            try:
                sent = os.write(self._fd, data)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._break(e)
                raise PipeBroken(f"socket failed: {e}") from e
            if sent == len(data):
                return
            data = data[sent:]
        self._buffer += data
        self._wake_flusher()

    def _wake_flusher(self) -> None:
        if self._idle_flusher is not None:
            trio.lowlevel.reschedule(self._idle_flusher)
            self._idle_flusher = None

    async def drained(self) -> None:
        """Wait while more than :data:`HIGH_WATER` bytes wait for the socket.

        What was written stays written if this is cancelled. Raises
        ``trio.BrokenResourceError`` if the pipe breaks meanwhile.
        """
        while self.buffered > HIGH_WATER:
            self._check()
            await self._progress.park()
        self._check()

    async def flush(self) -> None:
        """Return when every byte written has gone to the socket.

        Sends them itself unless another task is doing it (then waits for
        that one). :class:`TimeoutError` if the peer took nothing for
        ``send_timeout`` seconds, which breaks the pipe.
        """
        while True:
            self._check()
            self._gather()
            if not self._buffer:
                return
            if self._sending:
                await self._progress.park()
                continue
            self._sending = True
            try:
                await self._send_buffer()
            finally:
                self._sending = False
                self._progress.unpark_all()

    async def _send_buffer(self) -> None:
        if self._fd < 0:
            # Not a socket: hand everything to the stream's send_all.
            data = bytes(self._buffer)
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._break(e)
                raise
            del self._buffer[: len(data)]
            return
        while self._buffer:
            try:
                sent = os.write(self._fd, self._buffer)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._break(e)
                raise PipeBroken(f"socket failed: {e}") from e
            if sent:
                del self._buffer[:sent]
                self._progress.unpark_all()
                continue
            with trio.move_on_after(self._send_timeout) as waiting:
                await trio.lowlevel.wait_writable(self._fd)
            if waiting.cancelled_caught:
                failure = TimeoutError(f"peer did not read for {self._send_timeout} s")
                self._break(failure)
                raise failure

    async def run_flusher(self) -> None:
        """Send what writes gathered or the socket did not take, until the
        pipe breaks or this is cancelled. Raises what :meth:`flush` raises.
        """
        while True:
            if not self._buffer and not self._plain:
                self._idle_flusher = trio.lowlevel.current_task()

                def abort(_: object) -> trio.lowlevel.Abort:
                    self._idle_flusher = None
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
            self._burst = 0
            await self.flush()

    # --- reading ---------------------------------------------------------------

    async def receive_some(self) -> bytes:
        """The next bytes from the peer; b"" once it closed the connection cleanly.

        Waits only when nothing has arrived; otherwise it is still a
        checkpoint (a scheduling round), so a peer that sends without pause
        does not keep the reader from yielding.
        """
        if self._tls is None:
            self._check()
            return await self._receive_raw()
        waited = False
        while True:
            self._check()
            try:
                data = self._tls.read(_READ_SIZE)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                return b""
            except ssl.SSLError as e:
                if self._ragged_eof_ok and isinstance(e, ssl.SSLEOFError):
                    return b""
                self._break(e)
                raise PipeBroken(f"TLS failed: {e}") from e
            else:
                # Reading may have produced TLS's own answers (a KeyUpdate).
                self._take_ciphertext()
                if not waited:
                    await trio.lowlevel.checkpoint()
                return data
            raw = self._receive_nowait()
            if raw is None:
                waited = True
                raw = await self._receive_raw()
            if raw:
                self._in.write(raw)
            else:
                self._in.write_eof()

    def _receive_nowait(self) -> bytes | None:
        """What the socket has, without waiting: None if nothing (or not a socket)."""
        if self._fd < 0:
            return None
        try:
            return os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return None
        except OSError as e:
            self._break(e)
            raise PipeBroken(f"socket failed: {e}") from e

    async def _receive_raw(self) -> bytes:
        if self._fd < 0:
            try:
                return bytes(await self.stream.receive_some(_READ_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._break(e)
                raise
        data = self._receive_nowait()
        if data is not None:
            await trio.lowlevel.checkpoint()
            return data
        while True:
            await trio.lowlevel.wait_readable(self._fd)
            data = self._receive_nowait()
            if data is not None:
                return data

    # --- state -----------------------------------------------------------------

    def _check(self) -> None:
        # A socket closed behind our back would free its descriptor's
        # number for the next socket opened: never write to it again.
        if self._closed or (self._socket is not None and self._socket.fileno() < 0):
            raise PipeClosed("pipe closed")
        if self._broken is not None:
            raise PipeBroken(f"pipe broken: {self._broken!r}") from self._broken

    def _break(self, failure: BaseException) -> None:
        if self._broken is None:
            self._broken = failure
        self._progress.unpark_all()

    async def aclose(self) -> None:
        """Close the socket at once (what is still buffered is dropped)."""
        self._closed = True
        self._progress.unpark_all()
        await trio.aclose_forcefully(self.stream)
