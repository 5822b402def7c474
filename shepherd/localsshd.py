"""A real OpenSSH sshd on a loopback port, for the tests and the benchmarks.

`start_sshd` runs its own ``sshd -D -e`` with its own config, host key and
``authorized_keys``, listening on 127.0.0.1 only. We run as root and log in
as root, so the config allows root logins by key (``PermitRootLogin
prohibit-password``), does not insist on root-owned parent directories
(``StrictModes no``, the files live in a temporary folder) and has no PAM.
`stop_sshd` ends it. The calls are synchronous (start-up takes a few
milliseconds).
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.net import free_loopback_port
from shepherd.errors import ShepherdError

__all__ = ["LocalSshdError", "Sshd", "start_sshd", "stop_sshd"]


class LocalSshdError(ShepherdError):
    """The local sshd could not be started; the message says why."""


SSHD = "/usr/sbin/sshd"
# sshd refuses to start without its privilege separation directory, a path
# compiled into the binary. The Debian package creates it at boot only.
PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class Sshd:
    """A running sshd: where it listens and which host key it presents."""

    host: str
    port: int
    #: The host public key in SSH wire format (what the Shepherd records).
    host_key: bytes
    #: A directory private to this server, for files the test uploads.
    root: Path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def start_sshd(directory: Path, authorized_keys: list[str]) -> tuple[subprocess.Popen[bytes], Sshd]:
    """Start sshd with its files in ``directory``; return once it listens.

    Used by the tests' ``sshd`` fixture and by the benchmark. Raises
    `LocalSshdError` if sshd exits or does not listen within 10 seconds.
    """
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    host_key = Ed25519PrivateKey.generate()
    host_key_path = directory / "ssh_host_ed25519_key"
    _write_private(
        host_key_path,
        host_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    authorized = directory / "authorized_keys"
    authorized.write_text("".join(f"{k}\n" for k in authorized_keys))
    root = directory / "root"
    root.mkdir(exist_ok=True)
    config = directory / "sshd_config"
    # A port picked by the kernel for us; sshd binds it a few ms later. The
    # race with another process grabbing it is accepted for tests.
    port = free_loopback_port()
    config.write_text(
        f"""\
ListenAddress 127.0.0.1
Port {port}
HostKey {host_key_path}
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PidFile none
Subsystem sftp internal-sftp
# The benchmark opens many connections at once; the default (10:30:100)
# drops unauthenticated connections beyond 10.
MaxStartups 512
LogLevel ERROR
"""
    )
    process = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _wait_listening(process, port)
    wire = host_key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    host_key_blob = base64.b64decode(wire.split()[1])
    return process, Sshd("127.0.0.1", port, host_key_blob, root)


def _wait_listening(process: subprocess.Popen[bytes], port: int) -> None:
    """Poll the port until sshd accepts, failing fast if sshd exits."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            assert process.stderr is not None
            raise LocalSshdError(f"sshd exited: {process.stderr.read().decode(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)
    process.kill()
    raise LocalSshdError("sshd did not start listening within 10s")


def stop_sshd(process: subprocess.Popen[bytes]) -> None:
    """Stop sshd (SIGTERM, SIGKILL after 5 seconds) and reap it."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stderr is not None:
        process.stderr.close()
