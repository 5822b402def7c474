"""The Shepherd's own SSH identity: one Ed25519 key, persisted in a file.

Every Shepherd component that logs into machines uses the same key, so that a
fleet only needs one public key in its ``authorized_keys``. The key is loaded
from a path, or generated there on first start (OpenSSH private key format,
mode 0600) so that later starts, and operators, see the same key.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shepherd.errors import ShepherdError

logger = logging.getLogger("shepherd.ssh_key")


class SSHKeyError(ShepherdError):
    """The key file exists but cannot be used (unreadable, not a key, not Ed25519)."""


@dataclass(frozen=True)
class SSHKey:
    """An Ed25519 private key with its encodings precomputed."""

    private_key: Ed25519PrivateKey

    @property
    def openssh_private(self) -> bytes:
        """The private key in OpenSSH format (what ``ssh -i`` and asyncssh read)."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )

    @property
    def authorized_key(self) -> str:
        """The public key as one ``authorized_keys`` line (``ssh-ed25519 AAAA...``)."""
        public = self.private_key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return public.decode("ascii")

    @classmethod
    def generate(cls) -> SSHKey:
        return cls(Ed25519PrivateKey.generate())


def load_ssh_key(path: Path) -> SSHKey:
    """Load an Ed25519 key from ``path`` (OpenSSH or PKCS#8 PEM format).

    Raises :class:`SSHKeyError` naming the file if it cannot be read or is not
    an unencrypted Ed25519 private key; the file is never modified.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SSHKeyError(f"{path}: cannot read SSH key: {exc.strerror}") from exc
    key: object
    try:
        if b"BEGIN OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SSHKeyError(f"{path}: not a valid unencrypted private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SSHKeyError(f"{path}: SSH key is {type(key).__name__}, want Ed25519")
    return SSHKey(key)


def load_or_create_ssh_key(path: Path) -> SSHKey:
    """Load the key at ``path``, or generate one and persist it there (0600).

    Creation is atomic: the key is written to a temporary file beside ``path``
    and renamed over it, so a crash never leaves a half-written key that the
    next start would reject. A file that exists but is not a valid key raises
    :class:`SSHKeyError` and is left alone (it may be an operator's mistake,
    and replacing it would silently change the fleet's authorized key).
    """
    if path.exists():
        return load_ssh_key(path)
    key = SSHKey.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.openssh_private)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SSHKeyError(f"{path}: cannot create SSH key: {exc.strerror}") from exc
    logger.info("generated new SSH key %s: %s", path, key.authorized_key)
    return key
