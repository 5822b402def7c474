"""The node root's folders and files as records (see the package's docstring)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from common.durable import atomic_write
from metropolis.localstorage.checked import parse_checked, read_checked, write_checked
from metropolis.localstorage.errors import (
    InsecureSealError,
    LocalStorageError,
)
from metropolis.localstorage.fs import PRIVATE_DIR_MODE, dir_at, make_private_dir, open_dir
from metropolis.localstorage.rootcheck import check_root
from metropolis.proto.common import ClusterDirectory
from metropolis.proto.private import SealedConfiguration

__all__ = [
    "DataDirectory",
    "ESPDirectory",
    "EphemeralDirectory",
    "EtcdDataDirectory",
    "PKIDirectory",
    "Root",
    "SealedConfigurationFile",
]

logger = logging.getLogger("metropolis.localstorage")


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
        make_private_dir(self.path)

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
    #: Its kind, as a checked file (:func:`write_checked`).
    KIND = "sealed-configuration"
    _ADVICE = "restore it from a backup: it holds the node's unlock and join keys"

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
        payload = self._INSECURE_MAGIC + bytes(config)
        write_checked(self.path, self.KIND, payload, durable=durable)

    def verify(self) -> None:
        """Check that the file is whole (as :func:`read_checked`) without unsealing it.

        :class:`LocalStorageError` if it cannot be read, :class:`CorruptFile`
        if it is damaged. Logs nothing: nothing secret is read out.
        """
        read_checked(self.path, self.KIND, advice=self._ADVICE)

    def unseal(self, *, insecure: bool) -> SealedConfiguration:
        """Read the configuration back.

        Raises :class:`InsecureSealError` if ``insecure`` is false (nothing
        else can be unsealed), :class:`LocalStorageError` if the file is
        missing or was not written by :meth:`seal`, :class:`CorruptFile` if
        it is damaged.
        """
        if not insecure:
            raise InsecureSealError("no TPM available to unseal; pass insecure=True")
        raw = read_checked(self.path, self.KIND, advice=self._ADVICE)
        if not raw.startswith(self._INSECURE_MAGIC):
            raise LocalStorageError(f"{self.path} is not an insecurely sealed configuration")
        logger.warning("no TPM: reading plaintext sealed configuration %s", self.path)
        body = raw[len(self._INSECURE_MAGIC) :]
        return parse_checked(self.path, SealedConfiguration, body, advice=self._ADVICE)


@dataclass(frozen=True)
class ESPDirectory:
    """``esp/``: what a node finds on its boot partition."""

    path: Path

    @property
    def cluster_directory(self) -> Path:
        return self.path / "cluster_directory.pb"

    #: The cluster directory's kind, as a checked file (:func:`write_checked`).
    CLUSTER_DIRECTORY_KIND = "cluster-directory"
    _DIRECTORY_ADVICE = (
        "copy esp/cluster_directory.pb from another node of the cluster, or restore it "
        "from a backup"
    )

    def write_cluster_directory(self, directory: ClusterDirectory, *, durable: bool = True) -> None:
        """Store the cluster directory (world-readable: it only names public keys and hosts)."""
        write_checked(
            self.cluster_directory,
            self.CLUSTER_DIRECTORY_KIND,
            bytes(directory),
            mode=0o644,
            durable=durable,
        )

    def read_cluster_directory(self) -> ClusterDirectory:
        """Read the cluster directory.

        :class:`LocalStorageError` if it is missing, :class:`CorruptFile` if
        it is damaged (both name the file).
        """
        path = self.cluster_directory
        raw = read_checked(path, self.CLUSTER_DIRECTORY_KIND, advice=self._DIRECTORY_ADVICE)
        return parse_checked(path, ClusterDirectory, raw, advice=self._DIRECTORY_ADVICE)

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

    def check(self) -> None:
        """Refuse a root another local user could tamper with; change nothing.

        Raises :class:`UnsafeRootError` naming the path, its mode and what
        to do if the root is a symlink, is not ours, or is writable by group
        or others; if a folder above it is owned by another user (root
        aside) or writable by others without the sticky bit (either could
        rename the root away and put another in its place); if anything
        under it is a symlink, or a folder or file not ours or writable by
        group or others; or if a file under ``data/`` or ``ephemeral/``, or
        the sealed configuration, is readable by them. :class:`LocalStorageError`
        if the root cannot be opened (missing). Folders are opened through
        descriptors that do not follow symlinks. Reading only: the caller
        may be a node that runs (``owner --root``) while the check looks.
        """
        check_root(self.path)

    def create(self) -> None:
        """Create every directory of the layout (idempotent), refusing a hostile root.

        Runs :meth:`check` first (its errors), then creates what is missing:
        ``data/`` and ``ephemeral/`` and everything below are 0700 (one an
        older layout left 0755 is tightened: no one but us could have
        changed it, :meth:`check` saw to that); ``esp/`` is 0755 (it only
        holds the public cluster directory and the sealed, owner-only
        configuration). Every directory is created, checked and chmodded
        through descriptors opened without following symlinks.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o755)
        self.check()
        root = open_dir(self.path, self.path)
        try:
            for parts, dir_mode in _LAYOUT:
                fd = os.dup(root)
                try:
                    where = self.path
                    for part in parts:
                        where = where / part
                        child = dir_at(fd, part, dir_mode, where)
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
