"""The SSH adapter against a real OpenSSH sshd and real asyncssh servers."""

from __future__ import annotations

import base64
import re
import stat
from pathlib import Path

import asyncssh
import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa as rsa_key

from shepherd.localfleet import open_fleet, wait_until
from shepherd.localsshd import Sshd
from shepherd.ssh import (
    AuthenticationError,
    ChannelError,
    ConnectError,
    ConnectTimeout,
    HostKeyChanged,
    SSHClient,
)
from shepherd.ssh_key import SSHKey

# Safety bound for anything that talks to a server; never asserted on.
BOUND = 30


def _client(key: SSHKey, connect_timeout: float = 5.0) -> SSHClient:
    return SSHClient(key, username="root", connect_timeout=connect_timeout)


async def test_upload_and_run_on_openssh(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    target = sshd.root / "prog"
    # The bound matters if stdin's EOF is lost: tr would then wait forever.
    with trio.fail_after(BOUND):
        async with _client(shepherd_ssh_key).connect(
            sshd.host, sshd.port, known_host_key=None
        ) as c:
            assert c.host_key == sshd.host_key
            await c.upload(str(target), b"#!/bin/sh\ntr a-z A-Z\necho oops >&2\nexit 3\n")
            result = await c.run(str(target), stdin=b"hello")
    assert c.closed
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert (result.stdout, result.stderr, result.exit_status) == (b"HELLO", b"oops\n", 3)
    assert result.exit_signal is None
    # The upload went through a temporary name; nothing is left beside it.
    assert sorted(p.name for p in sshd.root.iterdir()) == ["prog"]


async def test_upload_replaces_existing_file(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    target = sshd.root / "prog"
    target.write_bytes(b"old and much longer than the new content")
    async with _client(shepherd_ssh_key).connect(sshd.host, sshd.port, known_host_key=None) as c:
        await c.upload(str(target), b"new")
    assert target.read_bytes() == b"new"


async def test_output_is_bounded(aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey) -> None:
    async with _client(shepherd_ssh_key).connect(sshd.host, sshd.port, known_host_key=None) as c:
        at_limit = await c.run("head -c 1000 /dev/zero", output_limit=1000)
        assert at_limit.stdout == bytes(1000)
        with pytest.raises(ChannelError, match="stdout exceeds 1000 bytes"):
            await c.run("head -c 1001 /dev/zero", output_limit=1000)
        with pytest.raises(ChannelError, match="stderr exceeds 1000 bytes"):
            await c.run("cat /dev/zero >&2", output_limit=1000)
        # The connection is still usable for the next command.
        assert (await c.run("echo ok")).stdout == b"ok\n"


async def test_recorded_host_key_is_accepted(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    client = _client(shepherd_ssh_key)
    async with client.connect(sshd.host, sshd.port, known_host_key=sshd.host_key) as c:
        result = await c.run("echo ok")
    assert result.stdout == b"ok\n"


async def test_changed_host_key_is_refused(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    other_host_key = SSHKey.generate().authorized_key.split()[1]
    recorded = base64.b64decode(other_host_key)
    with pytest.raises(HostKeyChanged, match="does not hold the recorded host key"):
        async with _client(shepherd_ssh_key).connect(sshd.host, sshd.port, known_host_key=recorded):
            pytest.fail("connected despite a changed host key")


async def test_host_key_of_another_type_is_a_changed_host_key(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    rsa = rsa_key.generate_private_key(public_exponent=65537, key_size=1024)
    recorded = base64.b64decode(
        rsa.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .split()[1]
    )
    with pytest.raises(HostKeyChanged, match="does not hold the recorded host key"):
        async with _client(shepherd_ssh_key).connect(sshd.host, sshd.port, known_host_key=recorded):
            pytest.fail("connected although the server's key is not the recorded one")


async def test_unreadable_recorded_host_key_is_refused(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    with pytest.raises(HostKeyChanged, match="unreadable"):
        async with _client(shepherd_ssh_key).connect(
            sshd.host, sshd.port, known_host_key=b"garbage"
        ):
            pytest.fail("connected with an unreadable recorded host key")


async def test_wrong_client_key_is_an_authentication_error(aio_loop: object, sshd: Sshd) -> None:
    with pytest.raises(AuthenticationError, match="refused our key for user 'root'") as caught:
        async with _client(SSHKey.generate()).connect(sshd.host, sshd.port, known_host_key=None):
            pytest.fail("logged in with a key that is not authorized")
    # The handshake completed before authentication failed: the server proved
    # it holds this key, so trust on first use can record it.
    assert caught.value.host_key == sshd.host_key


async def test_changed_host_key_names_the_presented_fingerprint(
    aio_loop: object, sshd: Sshd, shepherd_ssh_key: SSHKey
) -> None:
    presented = asyncssh.import_public_key(
        b"ssh-ed25519 " + base64.b64encode(sshd.host_key)
    ).get_fingerprint("sha256")
    recorded = base64.b64decode(SSHKey.generate().authorized_key.split()[1])
    with pytest.raises(HostKeyChanged, match=re.escape(f"ssh-ed25519 key {presented}")) as caught:
        async with _client(shepherd_ssh_key).connect(sshd.host, sshd.port, known_host_key=recorded):
            pytest.fail("connected despite a changed host key")
    assert caught.value.host_key is None  # never record an impostor's key


async def test_closed_port_is_a_connect_error(aio_loop: object, shepherd_ssh_key: SSHKey) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # bound, then closed: nothing listens there
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}"):
        async with _client(shepherd_ssh_key).connect("127.0.0.1", port, known_host_key=None):
            pytest.fail("connected to a closed port")


async def _never_answer(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


async def test_silent_server_hits_the_connect_timeout(
    aio_loop: object, shepherd_ssh_key: SSHKey
) -> None:
    # A TCP listener that accepts and never speaks SSH.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, _never_answer, listeners)
        with pytest.raises(ConnectTimeout, match=r"took longer than 0\.3s"):
            async with _client(shepherd_ssh_key, connect_timeout=0.3).connect(
                "127.0.0.1", port, known_host_key=None
            ):
                pytest.fail("connected to a server that never answered")
        nursery.cancel_scope.cancel()


async def test_trio_cancellation_crosses_the_bridge_and_closes(
    aio_loop: object, tmp_path: Path, shepherd_ssh_key: SSHKey
) -> None:
    """Cancelling a Trio scope around a remote command (what the exec timeout
    does) cancels the asyncio side and closes the connection."""
    async with open_fleet(tmp_path, count=1, authorized_key=shepherd_ssh_key.authorized_key) as f:
        machine = f.machines[0]
        client = _client(shepherd_ssh_key)
        scope = trio.CancelScope()

        async def cancel_once_running() -> None:
            await wait_until(lambda: machine.execs == 1)
            scope.cancel()

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_running)
                with scope:
                    async with client.connect(
                        machine.host, machine.port, known_host_key=None
                    ) as conn:
                        await conn.run("sleep 60")
        assert scope.cancelled_caught
        assert conn.closed
        # The server side sees the connection go and kills the command.
        with trio.fail_after(10):
            await wait_until(lambda: machine.open_connections == 0 and machine.killed == 1)
        assert (machine.execs, machine.killed, machine.closed_connections) == (1, 1, 1)
        # The bridge is still usable afterwards.
        async with client.connect(machine.host, machine.port, known_host_key=None) as conn:
            assert (await conn.run("echo again")).stdout == b"again\n"


async def _client_kexinit(client: SSHClient, known_host_key: bytes | None) -> list[list[str]]:
    """What ``client`` offers: the name-lists of its KEXINIT, caught by a
    hostile server that answers the version exchange and then reads it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    offered: list[list[str]] = []

    async def serve(stream: trio.SocketStream) -> None:
        await stream.send_all(b"SSH-2.0-Hostile_1.0\r\n")
        data = b""
        while b"\r\n" not in data:
            data += await stream.receive_some()
        data = data.split(b"\r\n", 1)[1]
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            data += await stream.receive_some()
        payload = data[5 : 4 + int.from_bytes(data[:4], "big")]
        assert payload[0] == 20  # SSH_MSG_KEXINIT
        pos = 17  # message type and cookie
        for _ in range(10):
            length = int.from_bytes(payload[pos : pos + 4], "big")
            offered.append(payload[pos + 4 : pos + 4 + length].decode().split(","))
            pos += 4 + length
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        with trio.fail_after(BOUND), pytest.raises(ConnectError):
            async with client.connect("127.0.0.1", port, known_host_key=known_host_key):
                pass
        nursery.cancel_scope.cancel()
    return offered


async def test_only_modern_algorithms_are_offered(
    aio_loop: object, shepherd_ssh_key: SSHKey
) -> None:
    rsa = rsa_key.generate_private_key(public_exponent=65537, key_size=1024)
    recorded_rsa = base64.b64decode(
        rsa.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .split()[1]
    )
    for known in (None, recorded_rsa):
        kex, host_key, cipher, _, mac, _, *_ = await _client_kexinit(
            _client(shepherd_ssh_key), known
        )
        offered = [*kex, *host_key, *cipher, *mac]
        for legacy in ("sha1", "ssh-rsa", "ssh-dss", "cbc", "arcfour", "md5", "umac-64", "gss"):
            assert not [alg for alg in offered if legacy in alg], (legacy, offered)
        assert "curve25519-sha256" in kex and "ssh-ed25519" in host_key
        assert "chacha20-poly1305@openssh.com" in cipher and "hmac-sha2-256-etm@openssh.com" in mac
        if known is not None:
            assert set(host_key[:2]) == {"rsa-sha2-512", "rsa-sha2-256"}  # recorded type first
