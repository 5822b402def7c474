"""SSH client for the Shepherd: the one module that talks to asyncssh.

asyncssh is an asyncio library. Everything here runs it through
``trio_asyncio.aio_as_trio``, so callers see plain Trio functions and Trio
cancellation: cancelling a caller's scope cancels the asyncio operation in
flight, and the connection is then closed (see :meth:`SSHClient.connect`).
The process must be running inside ``trio_asyncio.open_loop()``.

Typical use::

    client = SSHClient(key, username="root", connect_timeout=2.0)
    async with client.connect("192.0.2.1", 22, known_host_key=None) as conn:
        first_seen = conn.host_key           # record it: trust on first use
        await conn.upload("/root/agent", agent_bytes)
        result = await conn.run("/root/agent", stdin=init_bytes)

Host keys are trust-on-first-use: with ``known_host_key=None`` any host key is
accepted and reported as :attr:`SSHConnection.host_key`; with a key, the key
exchange only succeeds if the server proves it holds that same key, otherwise
:class:`HostKeyChanged` is raised before we authenticate.

Errors form one hierarchy rooted at :class:`SSHError`; asyncssh's and the OS's
exceptions never escape this module.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
import trio_asyncio

from common.cli import leaf_errors
from shepherd.asyncssh_import import asyncssh
from shepherd.errors import ShepherdError
from shepherd.ssh_key import SSHKey

logger = logging.getLogger("shepherd.ssh")

# Not exported by asyncssh's top level (asyncssh.public_key is an internal
# module), so an asyncssh release may move it; tests/shepherd/test_ssh.py
# connects with a recorded host key, which fails loudly if it does.
decode_ssh_public_key = asyncssh.public_key.decode_ssh_public_key

#: Most bytes :meth:`SSHConnection.run` accepts on stdout (and on stderr).
DEFAULT_OUTPUT_LIMIT = 1 << 20

_READ_SIZE = 1 << 16

# How long closing a connection may take. Closing runs shielded from
# cancellation (it is what cancellation needs to happen), so it needs its own
# bound in case the peer stops reading.
_CLOSE_TIMEOUT = 5.0


# Modern algorithms only, as OpenSSH's defaults: nothing built on SHA-1
# (diffie-hellman-group14-sha1, ssh-rsa signatures, hmac-sha1), no CBC or
# arcfour ciphers, no 64-bit-tag MACs. The order is our preference.
KEX_ALGORITHMS = (
    "mlkem768x25519-sha256",
    "curve25519-sha256",
    "curve25519-sha256@libssh.org",
    "ecdh-sha2-nistp256",
    "ecdh-sha2-nistp384",
    "ecdh-sha2-nistp521",
    "diffie-hellman-group-exchange-sha256",
    "diffie-hellman-group16-sha512",
    "diffie-hellman-group18-sha512",
    "diffie-hellman-group14-sha256",
)
HOST_KEY_ALGORITHMS = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "rsa-sha2-512",
    "rsa-sha2-256",
)
# AES-GCM before ChaCha20-Poly1305, unlike OpenSSH: both are sound, but
# asyncssh seals a ChaCha20-Poly1305 packet with several calls from Python
# (two ChaCha20 contexts and a Poly1305) and an AES-GCM one with a single
# OpenSSL call, and the agent upload is thousands of packets per machine.
CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes256-ctr",
    "aes192-ctr",
    "aes128-ctr",
)
MACS = (
    "hmac-sha2-256-etm@openssh.com",
    "hmac-sha2-512-etm@openssh.com",
    "umac-128-etm@openssh.com",
    "hmac-sha2-256",
    "hmac-sha2-512",
    "umac-128@openssh.com",
)


class SSHError(ShepherdError):
    """Base class of everything this module raises.

    ``host_key`` is the server's host key (SSH wire format) when the failure
    came after a completed key exchange, in which the server proved that it
    holds that key: trust on first use may record it even though the
    connection failed. None before that point, and for :class:`HostKeyChanged`.
    """

    def __init__(self, message: str, host_key: bytes | None = None) -> None:
        super().__init__(message)
        self.host_key = host_key


class ConnectError(SSHError):
    """No SSH session could be set up: refused, unreachable, protocol failure."""


class ConnectTimeout(ConnectError):
    """The TCP connect plus SSH handshake did not finish within the connect timeout."""


class AuthenticationError(SSHError):
    """The server did not accept our key for the requested user."""


class HostKeyChanged(SSHError):
    """The server does not hold the host key recorded for this machine."""


class ChannelError(SSHError):
    """An operation on an established connection failed (upload, exec, lost link)."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one remote command."""

    stdout: bytes
    stderr: bytes
    #: The exit status, or None if the command was killed by a signal or the
    #: server did not report one.
    exit_status: int | None
    #: The signal name (e.g. ``"KILL"``) if the command was killed by one.
    exit_signal: str | None


class SSHConnection:
    """An authenticated SSH connection; obtained from :meth:`SSHClient.connect`."""

    def __init__(self, conn: asyncssh.SSHClientConnection) -> None:
        self._conn = conn
        server_key = conn.get_server_host_key()
        # Set by asyncssh after a completed key exchange, so never None here.
        assert server_key is not None
        self._host_key = server_key.public_data

    @property
    def host_key(self) -> bytes:
        """The server's public host key, SSH wire format (as in ``known_hosts``)."""
        return self._host_key

    @property
    def closed(self) -> bool:
        """True once the underlying connection is closed (by us or the peer)."""
        return self._conn.is_closed()

    async def upload(self, path: str, data: bytes, mode: int = 0o755) -> None:
        """Write ``data`` to ``path`` over SFTP, with permissions ``mode``.

        The bytes go to a uniquely named ``<path>.upload-<random>`` first and
        are renamed over ``path`` once complete, so a half-uploaded copy is
        never executed, a running binary never blocks the upload with ETXTBSY,
        and concurrent uploads to one path do not interleave.

        Raises :class:`ChannelError` on any SFTP or connection failure.
        Cancellation leaves at most the temporary file behind.
        """
        tmp = f"{path}.upload-{secrets.token_hex(8)}"
        try:
            await trio_asyncio.aio_as_trio(self._upload)(tmp, path, data, mode)
        except (asyncssh.Error, OSError) as exc:
            raise ChannelError(f"upload to {path} failed: {_describe(exc)}") from exc

    async def _upload(self, tmp: str, path: str, data: bytes, mode: int) -> None:
        async with self._conn.start_sftp_client() as sftp:
            async with sftp.open(tmp, "wb") as f:
                await f.write(data)
            await sftp.chmod(tmp, mode)
            await sftp.posix_rename(tmp, path)

    async def _run(self, command: str, stdin: bytes, limit: int) -> ExecResult:
        # Not SSHClientConnection.run(input=...): it sends no EOF when the
        # input is empty (a command reading stdin would never end), and it
        # buffers output without bound.
        process = await self._conn.create_process(command, encoding=None)
        process.stdin.write(stdin)
        process.stdin.write_eof()
        # A TaskGroup, so that one stream over its limit stops the other read.
        try:
            async with asyncio.TaskGroup() as group:
                stdout = group.create_task(_read_bounded(process.stdout, limit, "stdout"))
                stderr = group.create_task(_read_bounded(process.stderr, limit, "stderr"))
        except ExceptionGroup as failed:
            process.close()  # stop the flood now, not when the connection closes
            raise leaf_errors(failed)[0] from None
        await process.wait_closed()
        signal = process.exit_signal[0] if process.exit_signal else None
        return ExecResult(stdout.result(), stderr.result(), process.exit_status, signal)

    async def run(
        self, command: str, stdin: bytes = b"", *, output_limit: int = DEFAULT_OUTPUT_LIMIT
    ) -> ExecResult:
        """Run ``command`` remotely, feed it ``stdin`` then EOF, and wait for it to exit.

        A non-zero exit status is not an error: it is reported in the result.
        Raises :class:`ChannelError` if the session fails, or if the command
        writes more than ``output_limit`` bytes to stdout or to stderr (a
        runaway program must not exhaust our memory). On cancellation the
        remote command is abandoned; closing the connection ends its session.
        """
        try:
            result: ExecResult = await trio_asyncio.aio_as_trio(self._run)(
                command, stdin, output_limit
            )
        except (asyncssh.Error, OSError) as exc:
            raise ChannelError(f"running {shlex.quote(command)} failed: {_describe(exc)}") from exc
        except _OutputTooLarge as exc:
            raise ChannelError(f"running {shlex.quote(command)} failed: {exc}") from None
        return result


class _OutputTooLarge(ShepherdError):
    pass


async def _read_bounded(stream: asyncssh.SSHReader[bytes], limit: int, name: str) -> bytes:
    """Read ``stream`` to EOF; raise _OutputTooLarge past ``limit`` bytes."""
    chunks: list[bytes] = []
    total = 0
    while chunk := await stream.read(_READ_SIZE):
        total += len(chunk)
        if total > limit:
            raise _OutputTooLarge(f"{name} exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class SSHClient:
    """Dials machines as one user with one key.

    Holds no connections itself: each :meth:`connect` owns its connection for
    the duration of its ``async with`` block.
    """

    def __init__(self, key: SSHKey, *, username: str, connect_timeout: float) -> None:
        self._key = asyncssh.import_private_key(key.openssh_private)
        self._username = username
        self._connect_timeout = connect_timeout

    @asynccontextmanager
    async def connect(
        self, host: str, port: int, *, known_host_key: bytes | None
    ) -> AsyncIterator[SSHConnection]:
        """Open an authenticated connection to ``host:port``; close it on exit.

        ``known_host_key`` is the host key recorded for this machine (SSH wire
        format), or None to accept and report whatever key the server has.

        Raises :class:`ConnectTimeout`, :class:`ConnectError`,
        :class:`AuthenticationError` or :class:`HostKeyChanged`. Cancellation
        at any point (during the handshake or inside the block) closes the
        connection before it propagates; the close itself is shielded and
        bounded by a few seconds.
        """
        known_hosts: object = None
        host_key_algs: list[str] = list(HOST_KEY_ALGORITHMS)
        if known_host_key is not None:
            try:
                trusted = decode_ssh_public_key(known_host_key)
            except (asyncssh.KeyImportError, ValueError) as exc:
                # Bad data in the BMDB must not turn into "accept anything".
                raise HostKeyChanged(f"recorded host key is unreadable: {exc}") from exc
            known_hosts = ([trusted], [], [])
            # Ask for the recorded key's type first, as OpenSSH does, but
            # accept others: a server whose key changed type must fail as a
            # changed key, not with the connection reset that sshd answers
            # when no host key algorithm is common (asyncssh's default here).
            own = [a.decode() for a in trusted.sig_algorithms if a.decode() in HOST_KEY_ALGORITHMS]
            host_key_algs = own + [a for a in HOST_KEY_ALGORITHMS if a not in own]
        conn: asyncssh.SSHClientConnection | None = None
        observer = _Observer()
        with trio.move_on_after(self._connect_timeout) as timeout:
            try:
                conn = await trio_asyncio.aio_as_trio(asyncssh.connect)(
                    host,
                    port,
                    client_factory=lambda: observer,
                    username=self._username,
                    client_keys=[self._key],
                    known_hosts=known_hosts,
                    # Nothing from the environment: no ~/.ssh/config, no agent,
                    # no default keys; only what the Shepherd was configured with.
                    config=None,
                    agent_path=None,
                    preferred_auth="publickey",
                    server_host_key_algs=host_key_algs,
                    kex_algs=list(KEX_ALGORITHMS),
                    encryption_algs=list(CIPHERS),
                    mac_algs=list(MACS),
                    # Never GSS-API (Kerberos): no gss-* key exchange, no
                    # gssapi-with-mic authentication, whatever is installed.
                    gss_host=None,
                    gss_kex=False,
                    gss_auth=False,
                )
            except asyncssh.HostKeyNotVerifiable as exc:
                presented = (
                    f"it presented {observer.presented.get_algorithm()} key "
                    f"{observer.presented.get_fingerprint('sha256')}"
                    if observer.presented is not None
                    else exc.reason
                )
                raise HostKeyChanged(
                    f"{host}:{port} does not hold the recorded host key ({presented})"
                ) from exc
            except asyncssh.PermissionDenied as exc:
                raise AuthenticationError(
                    f"{host}:{port} refused our key for user {self._username!r}",
                    observer.host_key,
                ) from exc
            except (asyncssh.Error, OSError) as exc:
                raise ConnectError(
                    f"cannot connect to {host}:{port}: {_describe(exc)}", observer.host_key
                ) from exc
        if conn is None:
            assert timeout.cancelled_caught
            raise ConnectTimeout(
                f"connecting to {host}:{port} took longer than {self._connect_timeout:g}s",
                observer.host_key,
            )
        try:
            yield SSHConnection(conn)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
                conn.close()
                await trio_asyncio.aio_as_trio(conn.wait_closed)()


class _Observer(asyncssh.SSHClient):
    """Watches one connection's handshake for what the errors must report.

    ``presented`` is the host key the server offered when it was not the
    recorded one (asyncssh asks us about it before refusing it), for the
    mismatch message. ``host_key`` is set once authentication begins, which
    asyncssh only does after the key exchange completed and the server's
    signature checked out: from then on the key is proven, even if
    authentication or anything later fails.
    """

    def __init__(self) -> None:
        self._conn: asyncssh.SSHClientConnection | None = None
        self.presented: asyncssh.SSHKey | None = None
        self.host_key: bytes | None = None

    def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
        self._conn = conn

    def validate_host_public_key(
        self, host: str, addr: str, port: int, key: asyncssh.SSHKey
    ) -> bool:
        # Only called for a key that is not the recorded one: refuse it.
        self.presented = key
        return False

    def begin_auth(self, username: str) -> None:
        assert self._conn is not None
        server_key = self._conn.get_server_host_key()
        if server_key is not None:
            self.host_key = server_key.public_data


def _describe(exc: BaseException) -> str:
    """A one-line, human readable description of an asyncssh or OS error."""
    if isinstance(exc, asyncssh.DisconnectError | asyncssh.ChannelOpenError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, asyncssh.SFTPError):
        return f"SFTP: {exc.reason}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
