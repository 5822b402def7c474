"""The node's on-disk layout, atomic file writes, and the sealed configuration.

One root directory per node::

    <root>/
      data/                       persistent, private (0700)
        etcd/                     consensus member state
          data/                   etcd's --data-dir
          peer_pki/               ca.pem, cert.pem, key.pem   (peer TLS)
          peer_crl.pem            CRL etcd re-reads per peer connection
        node/credentials/         ca.pem, cert.pem, key.pem   (node identity)
      ephemeral/                  cleared on boot on a real node, private (0700)
        consensus/                etcd's working dir: client socket "client.sock:0"
      esp/                        what the boot partition holds
        cluster_directory.pb      ClusterDirectory (who to contact), 0644
        sealed_configuration.pb   SealedConfiguration (node secrets), 0600

Every file is written with :func:`atomic_write` so that a crash leaves
either the old or the new content, never a torn mix: readers (and etcd, for
the CRL) never observe half a file.

Path objects here are plain records; nothing touches the disk until a method
says so (:meth:`Root.create`, :func:`atomic_write`, :meth:`SealedConfigurationFile.seal`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from metropolis.errors import MetropolisError
from metropolis.proto.common import ClusterDirectory
from metropolis.proto.private import SealedConfiguration

__all__ = [
    "DataDirectory",
    "ESPDirectory",
    "EphemeralDirectory",
    "EtcdDataDirectory",
    "InsecureSealError",
    "LocalStorageError",
    "PKIDirectory",
    "Root",
    "SealedConfigurationFile",
    "atomic_write",
    "make_durable",
    "read_file",
]

logger = logging.getLogger("metropolis.localstorage")

#: Private directories and files: the node's secrets live here.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class LocalStorageError(MetropolisError):
    """A local storage file is missing, unreadable or malformed."""


class InsecureSealError(LocalStorageError):
    """Sealing or unsealing needs a TPM, or explicit consent to do without one."""


def atomic_write(
    path: Path, data: bytes, mode: int = PRIVATE_FILE_MODE, *, durable: bool = True
) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a mix.

    The steps, and why each is there::

        temp file in the same directory (rename is only atomic within a filesystem)
          -> chmod to ``mode`` before any byte is written (secrets never world-readable)
          -> write + fsync (data is on disk before the name points at it)
          -> rename over ``path`` (the atomic switch)
          -> fsync the directory (the rename itself survives a crash)

    On any error the temp file is removed and ``path`` is untouched. Blocking
    I/O: call from a thread (``trio.to_thread.run_sync``) if latency matters.

    ``durable=False`` skips both fsyncs: still atomic for readers, but not
    yet crash-proof; the caller must :func:`make_durable` the path before
    anything depends on it surviving a power cut (this lets the syncing
    overlap other work).
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_directory(directory)


def make_durable(paths: list[Path]) -> None:
    """fsync the files, then their directories: what ``atomic_write(durable=False)`` skipped.

    The fsyncs run in parallel threads: the filesystem commits them in one
    journal transaction, about a third of the time of one after another.
    """

    def fsync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(fsync, paths))
        list(pool.map(fsync, dict.fromkeys(p.parent for p in paths)))


def fsync_directory(directory: Path) -> None:
    """fsync ``directory`` itself: what makes a rename or unlink in it survive a crash."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str | Path, where: Path, dir_fd: int | None = None) -> int:
    """Open directory ``name`` without following a symlink; refuse one not ours."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LocalStorageError(f"{where} is a symbolic link or not a directory") from e
        raise LocalStorageError(f"cannot open {where}: {e.strerror}") from e
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise LocalStorageError(f"{where} is owned by uid {owner}, not by us ({os.geteuid()})")
    return fd


def _dir_at(parent_fd: int, name: str, mode: int, where: Path) -> int:
    """Create (or open) ``name`` in ``parent_fd`` with exactly ``mode``; its descriptor.

    Everything through descriptors: no path is resolved twice, so nothing
    can be swapped for a symlink between the check and the chmod. mkdir's
    mode is filtered by the umask and not applied to existing directories,
    hence the explicit fchmod (a directory left 0755 by an older layout
    would otherwise keep leaking file names).
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=parent_fd)
    fd = _open_dir(name, where, dir_fd=parent_fd)
    os.fchmod(fd, mode)
    return fd


def _make_private_dir(path: Path) -> None:
    # Parents are the caller's business (a Root checks its own tree); the
    # directory itself must be a real, owned, private one.
    path.parent.mkdir(parents=True, exist_ok=True)
    parent = _open_dir(path.parent, path.parent)
    try:
        os.close(_dir_at(parent, path.name, PRIVATE_DIR_MODE, path))
    finally:
        os.close(parent)


def read_file(path: Path) -> bytes:
    """The bytes of ``path``, refusing to follow a symlink there.

    Raises :class:`LocalStorageError` naming the file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LocalStorageError(f"{path} is a symbolic link; refusing it") from e
        raise LocalStorageError(f"cannot read {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _refuse_symlinks(directory_fd: int, where: Path) -> None:
    """Raise if anything below ``directory_fd`` is a symlink or a folder not ours."""
    with os.scandir(directory_fd) as entries:
        for entry in entries:
            if entry.is_symlink():
                raise LocalStorageError(f"{where / entry.name} is a symbolic link; refusing it")
            if entry.is_dir(follow_symlinks=False):
                fd = _open_dir(entry.name, where / entry.name, dir_fd=directory_fd)
                try:
                    _refuse_symlinks(fd, where / entry.name)
                finally:
                    os.close(fd)


@dataclass(frozen=True)
class PKIDirectory:
    """A folder with a CA certificate, a certificate and its private key (PEM files)."""

    path: Path

    @property
    def ca_certificate(self) -> Path:
        return self.path / "ca.pem"

    @property
    def certificate(self) -> Path:
        return self.path / "cert.pem"

    @property
    def key(self) -> Path:
        return self.path / "key.pem"

    def files(self) -> tuple[Path, Path, Path]:
        return (self.ca_certificate, self.certificate, self.key)

    def all_absent(self) -> bool:
        return not any(p.exists() for p in self.files())

    def all_present(self) -> bool:
        return all(p.exists() for p in self.files())

    def create(self) -> None:
        _make_private_dir(self.path)

    def write_all(
        self, ca_certificate: bytes, certificate: bytes, key: bytes, *, durable: bool = True
    ) -> None:
        """Write all three files (owner-only) atomically each, the key last.

        The key goes last so that a crash part-way leaves no key paired with
        a stale certificate without the loader noticing the mismatch.
        """
        self.create()
        atomic_write(self.ca_certificate, ca_certificate, durable=durable)
        atomic_write(self.certificate, certificate, durable=durable)
        atomic_write(self.key, key, durable=durable)


@dataclass(frozen=True)
class EtcdDataDirectory:
    """``data/etcd``: what a consensus member keeps across reboots."""

    path: Path

    @property
    def data(self) -> Path:
        """etcd's own ``--data-dir``."""
        return self.path / "data"

    @property
    def peer_pki(self) -> PKIDirectory:
        return PKIDirectory(self.path / "peer_pki")

    @property
    def peer_crl(self) -> Path:
        return self.path / "peer_crl.pem"


@dataclass(frozen=True)
class DataDirectory:
    """``data/``: persistent private state."""

    path: Path

    @property
    def etcd(self) -> EtcdDataDirectory:
        return EtcdDataDirectory(self.path / "etcd")

    @property
    def node_credentials(self) -> PKIDirectory:
        return PKIDirectory(self.path / "node" / "credentials")


@dataclass(frozen=True)
class EphemeralDirectory:
    """``ephemeral/``: runtime files (sockets) that must not survive a reboot."""

    path: Path

    @property
    def consensus(self) -> Path:
        """etcd's working directory; its client socket lives here."""
        return self.path / "consensus"


@dataclass(frozen=True)
class SealedConfigurationFile:
    """``esp/sealed_configuration.pb``: the node's secrets, sealed to this machine.

    A real node seals with its TPM so that the file is useless elsewhere. No
    TPM is used here, so the only available mode is *insecure*: the message
    is stored in plain text behind a marker header. Both :meth:`seal` and
    :meth:`unseal` refuse unless the caller passes ``insecure=True``, and
    both log a warning when they proceed, so nobody runs unsealed by accident.
    """

    path: Path

    # The marker tells an unsealer what it is holding: a plaintext file can
    # never be mistaken for (or silently replaced by) a TPM-sealed one.
    _INSECURE_MAGIC = b"METROPOLIS-INSECURE-SEAL-V1\n"

    def seal(self, config: SealedConfiguration, *, insecure: bool, durable: bool = True) -> None:
        """Write ``config`` (owner-only, atomically).

        Raises :class:`InsecureSealError` unless ``insecure`` is true: there
        is no TPM support, so plaintext is the only option and must be asked for.
        """
        if not insecure:
            raise InsecureSealError(
                "no TPM available to seal the configuration; pass insecure=True to store it "
                "in plain text"
            )
        logger.warning("no TPM: writing sealed configuration %s INSECURELY (plaintext)", self.path)
        atomic_write(self.path, self._INSECURE_MAGIC + bytes(config), durable=durable)

    def unseal(self, *, insecure: bool) -> SealedConfiguration:
        """Read the configuration back.

        Raises :class:`InsecureSealError` if ``insecure`` is false (nothing
        else can be unsealed), :class:`LocalStorageError` if the file is
        missing or was not written by :meth:`seal`.
        """
        if not insecure:
            raise InsecureSealError("no TPM available to unseal; pass insecure=True")
        raw = read_file(self.path)
        if not raw.startswith(self._INSECURE_MAGIC):
            raise LocalStorageError(f"{self.path} is not an insecurely sealed configuration")
        logger.warning("no TPM: reading plaintext sealed configuration %s", self.path)
        return SealedConfiguration.parse(raw[len(self._INSECURE_MAGIC) :])


@dataclass(frozen=True)
class ESPDirectory:
    """``esp/``: what a node finds on its boot partition."""

    path: Path

    @property
    def cluster_directory(self) -> Path:
        return self.path / "cluster_directory.pb"

    def write_cluster_directory(self, directory: ClusterDirectory, *, durable: bool = True) -> None:
        """Store the cluster directory (world-readable: it only names public keys and hosts)."""
        atomic_write(self.cluster_directory, bytes(directory), mode=0o644, durable=durable)

    def read_cluster_directory(self) -> ClusterDirectory:
        """Read the cluster directory; :class:`LocalStorageError` if it is missing."""
        raw = read_file(self.cluster_directory)
        return ClusterDirectory.parse(raw)

    @property
    def sealed_configuration(self) -> SealedConfigurationFile:
        return SealedConfigurationFile(self.path / "sealed_configuration.pb")


@dataclass(frozen=True)
class Root:
    """The root of one node's storage. See the module docstring for the layout."""

    path: Path

    @property
    def data(self) -> DataDirectory:
        return DataDirectory(self.path / "data")

    @property
    def ephemeral(self) -> EphemeralDirectory:
        return EphemeralDirectory(self.path / "ephemeral")

    @property
    def esp(self) -> ESPDirectory:
        return ESPDirectory(self.path / "esp")

    def create(self) -> None:
        """Create every directory of the layout (idempotent), refusing a hostile root.

        ``data/`` and ``ephemeral/`` and everything below are forced to 0700
        even if they existed with looser modes; ``esp/`` is 0755 (it only holds
        the public cluster directory and the sealed, owner-only configuration).

        Raises :class:`LocalStorageError` if the root is a symlink, is not
        ours, or is writable by group or others (someone else could swap its
        contents), or if anything under it is a symlink or a folder owned by
        someone else. Every directory is created, checked and chmodded
        through descriptors opened without following symlinks.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o755)
        root = _open_dir(self.path, self.path)
        try:
            mode = stat.S_IMODE(os.fstat(root).st_mode)
            if mode & 0o022:
                raise LocalStorageError(
                    f"{self.path} is writable by group or others (mode {mode:04o}); refusing it"
                )
            _refuse_symlinks(root, self.path)
            for parts, dir_mode in _LAYOUT:
                fd = os.dup(root)
                try:
                    where = self.path
                    for part in parts:
                        where = where / part
                        child = _dir_at(fd, part, dir_mode, where)
                        os.close(fd)
                        fd = child
                finally:
                    os.close(fd)
        finally:
            os.close(root)


# Every folder of the layout: path under the root, and the mode of each of its
# components that we create or tighten.
_LAYOUT: list[tuple[tuple[str, ...], int]] = [
    (("data", "etcd", "peer_pki"), PRIVATE_DIR_MODE),
    (("data", "node", "credentials"), PRIVATE_DIR_MODE),
    (("ephemeral", "consensus"), PRIVATE_DIR_MODE),
    (("esp",), 0o755),
]
