"""The Shepherd's own SSH identity: one Ed25519 key, persisted in a file.

Every Shepherd component that logs into machines uses the same key, so that a
fleet only needs one public key in its ``authorized_keys``. The key is loaded
from a path, or generated there on first start (OpenSSH private key format,
mode 0600) so that later starts, and operators, see the same key.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
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


#: A private key file is a few hundred bytes; anything this large is not one.
_MAX_KEY_FILE = 64 * 1024


def _read_private_file(path: Path) -> bytes:
    """Read ``path`` if, like OpenSSH demands, it is ours and private.

    Opened with ``O_NOFOLLOW`` (a symlink planted at the path is refused, not
    followed) and checked on the open descriptor, so the file checked is the
    file read: a regular file, owned by the current user, with no permission
    bits for group or others (0600 or tighter).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SSHKeyError(f"{path}: SSH key is a symbolic link; refusing it") from exc
        raise SSHKeyError(f"{path}: cannot read SSH key: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SSHKeyError(f"{path}: SSH key is not a regular file")
        if st.st_uid != os.geteuid():
            raise SSHKeyError(
                f"{path}: SSH key is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
            )
        if st.st_mode & 0o077:
            raise SSHKeyError(
                f"{path}: SSH key has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
                "accessible by group or others (chmod 600)"
            )
        try:
            data = f.read(_MAX_KEY_FILE + 1)
        except OSError as exc:
            raise SSHKeyError(f"{path}: cannot read SSH key: {exc.strerror}") from exc
    if len(data) > _MAX_KEY_FILE:
        raise SSHKeyError(f"{path}: {_MAX_KEY_FILE} bytes or more; not an SSH key")
    return data


def load_ssh_key(path: Path) -> SSHKey:
    """Load an Ed25519 key from ``path`` (OpenSSH or PKCS#8 PEM format).

    Raises :class:`SSHKeyError` naming the file if it is a symlink, not owned
    by the current user, accessible by group or others, unreadable, or not an
    unencrypted Ed25519 private key; the file is never modified.
    """
    data = _read_private_file(path)
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

    Creation is atomic and exclusive: the key is written to a temporary file
    beside ``path`` (unpredictable name, ``O_EXCL``) and hard-linked to
    ``path``, which fails if ``path`` appeared meanwhile. So a crash never
    leaves a half-written key, and of two processes starting at once the
    second loads the first one's key instead of replacing it. A file that
    exists but is not a usable key raises :class:`SSHKeyError` and is left
    alone (it may be an operator's mistake, and replacing it would silently
    change the fleet's authorized key). Creation is logged.
    """
    if os.path.lexists(path):
        return load_ssh_key(path)
    key = SSHKey.generate()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key.openssh_private)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path, follow_symlinks=False)
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        # Another process created it between our check and our link: use theirs.
        return load_ssh_key(path)
    except OSError as exc:
        raise SSHKeyError(f"{path}: cannot create SSH key: {exc.strerror}") from exc
    logger.info("generated new SSH key %s: %s", path, key.authorized_key)
    return key
