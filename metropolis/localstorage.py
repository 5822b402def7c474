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

Checked files. A file that is still short or different from what was
written can then only come from outside damage (a disk, a copy, a hand),
and protobuf cannot tell: betterproto2 parses a message cut at a field
boundary as a shorter valid one, and keeps unparseable tails as unknown
fields, so a ``roles.pb`` cut in half reads as a node without roles. The
node's own state files (the cluster directory, the sealed configuration,
and in :mod:`metropolis.roleserve.disk` the settings, intents and roles)
are therefore written by :func:`write_checked` behind one header line::

    METROPOLIS-FILE 1 <kind> <payload length> <SHA-256 of the payload, hex>\n<payload>

and read by :func:`read_checked`, which gives :class:`CorruptFile` naming
the file for a missing or malformed header, another kind, a format version
it does not know, a length or a digest that does not match. A text header
keeps the JSON files readable (``tail -n +2``); the kind catches one file
copied over another; the version leaves room for a TPM-sealed payload.
Files without the header (written before it existed) are refused the same
way rather than read unchecked: without it, damage cannot be told from
content, which is the very failure the header removes; such a root is
bootstrapped or registered anew. PEM files (credentials, peer PKI, the
owner certificate) stay plain: etcd reads some of them, and their parsers
plus :class:`~metropolis.identity.NodeCredentials`' checks (key, certificate
and CA fit together) already refuse a cut or changed one.

Root checks. :meth:`Root.check` is what every entry point that opens a
root runs first (``node bootstrap``, ``register``, ``run``, ``owner``;
through :meth:`Root.create` and :func:`metropolis.roleserve.disk.load`):
the root, every folder and file under it owned by us and not writable by
group or others, secrets under ``data/`` and the sealed configuration not
readable by them either, no symlink anywhere, and no folder above the root
that another user could rename it out of. It refuses with
:class:`UnsafeRootError`, naming the path, its mode and the command that
fixes it; it never changes a mode itself (who loosened it, and did they
swap something meanwhile, is the operator's question).

Path objects here are plain records; nothing touches the disk until a method
says so (:meth:`Root.create`, :func:`atomic_write`, :meth:`SealedConfigurationFile.seal`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import betterproto2

from common.numbers import parse_decimal
from metropolis.errors import MetropolisError
from metropolis.proto.common import ClusterDirectory
from metropolis.proto.private import SealedConfiguration

__all__ = [
    "CorruptFile",
    "DataDirectory",
    "ESPDirectory",
    "EphemeralDirectory",
    "EtcdDataDirectory",
    "InsecureSealError",
    "LocalStorageError",
    "PKIDirectory",
    "Root",
    "SealedConfigurationFile",
    "UnsafeRootError",
    "atomic_write",
    "checked_content",
    "make_durable",
    "parse_checked",
    "read_checked",
    "read_file",
    "write_checked",
]

logger = logging.getLogger("metropolis.localstorage")

#: Private directories and files: the node's secrets live here.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class LocalStorageError(MetropolisError):
    """A local storage file is missing, unreadable or malformed."""


class InsecureSealError(LocalStorageError):
    """Sealing or unsealing needs a TPM, or explicit consent to do without one."""


class UnsafeRootError(LocalStorageError):
    """A node root, or a folder or file in it, that another local user could
    swap or change (or read, for a secret): a symlink, someone else's, or too
    loose a mode. The message names the path and what to do."""


class CorruptFile(LocalStorageError):
    """A file the node wrote reads back cut short, changed, or not as written.

    ``path`` is the file, ``reason`` what is wrong with it; the message adds
    what the operator can do.
    """

    def __init__(self, path: Path, reason: str, advice: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is damaged: {reason}" + (f"; {advice}" if advice else ""))


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
            raise UnsafeRootError(
                f"{where} is a symbolic link or not a directory; refusing it (put the real "
                "folder there)"
            ) from e
        raise LocalStorageError(f"cannot open {where}: {e.strerror}") from e
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise UnsafeRootError(
            f"{where} is owned by uid {owner}, not by us ({os.geteuid()}); refusing it: "
            f"check it, then chown {os.geteuid()} {where}, or run as uid {owner}"
        )
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


_MAGIC = b"METROPOLIS-FILE"
_VERSION = b"1"
#: Magic, version, a kind, twelve digits of length and 64 of digest fit well within.
_MAX_HEADER = 160

_Message = TypeVar("_Message", bound=betterproto2.Message)


def checked_content(kind: str, payload: bytes) -> bytes:
    """``payload`` behind its header line: what :func:`write_checked` writes."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b" ".join([_MAGIC, _VERSION, kind.encode(), b"%d" % len(payload), digest]) + (
        b"\n" + payload
    )


def write_checked(
    path: Path, kind: str, payload: bytes, mode: int = PRIVATE_FILE_MODE, *, durable: bool = True
) -> None:
    """:func:`atomic_write` ``payload`` behind a header of ``kind``, length and digest."""
    atomic_write(path, checked_content(kind, payload), mode, durable=durable)


def read_checked(path: Path, kind: str, *, advice: str = "") -> bytes:
    """The payload :func:`write_checked` stored in ``path`` as ``kind``.

    Raises :class:`LocalStorageError` if the file cannot be read (missing,
    a symlink), :class:`CorruptFile` (its message ending in ``advice``) if
    it has no valid header, is of another kind, or its payload does not
    match the header's length and SHA-256. Never modifies the file.
    """
    raw = read_file(path)

    def corrupt(reason: str) -> CorruptFile:
        return CorruptFile(path, reason, advice)

    end = raw.find(b"\n", 0, _MAX_HEADER)
    if not raw:
        raise corrupt("it is empty")
    if not raw.startswith(_MAGIC + b" "):
        if _MAGIC.startswith(raw[: len(_MAGIC)]):
            raise corrupt(f"cut short inside its header ({len(raw)} bytes)")
        raise corrupt(
            "no METROPOLIS-FILE header (not written by this version of metropolis, "
            "so damage cannot be told from content)"
        )
    if end < 0:
        raise corrupt(f"cut short inside its header ({len(raw)} bytes)")
    fields = raw[:end].split(b" ")
    payload = raw[end + 1 :]
    if len(fields) != 5:
        raise corrupt("malformed header")
    _, version, found_kind, length_text, digest = fields
    if version != _VERSION:
        shown = version.decode("ascii", "replace")
        raise corrupt(f"format version {shown!r} (this metropolis reads version 1)")
    if found_kind != kind.encode():
        raise corrupt(f"it holds a {found_kind.decode('ascii', 'replace')!r} file, not {kind!r}")
    try:
        length = parse_decimal(length_text, max_digits=12, what="payload length")
    except ValueError as e:
        raise corrupt(f"malformed header ({e})") from None
    if len(payload) < length:
        raise corrupt(f"cut short: {len(payload)} of {length} bytes")
    if len(payload) > length:
        raise corrupt(f"{len(payload) - length} bytes more than its header says")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise corrupt("its content does not match its SHA-256 (changed after it was written)")
    return payload


def parse_checked(
    path: Path, message_type: type[_Message], payload: bytes, *, advice: str = ""
) -> _Message:
    """``payload`` (read from ``path``) parsed as ``message_type``; :class:`CorruptFile` if not.

    After :func:`read_checked` a payload that does not parse was written by
    something else (another version), not damaged.
    """
    try:
        return message_type.parse(payload)
    # betterproto2 raises assorted errors on bad input, hence the broad catch.
    except Exception as e:
        raise CorruptFile(
            path, f"does not parse as {message_type.__name__} ({type(e).__name__}: {e})", advice
        ) from e


#: Top-level folders whose every file is a secret (owner-only).
_PRIVATE_TOP = frozenset({"data", "ephemeral"})
#: Files elsewhere that are secrets.
_SECRET_FILES = frozenset({"sealed_configuration.pb"})


def _too_loose(path: Path, mode: int, what: str, fix: str) -> UnsafeRootError:
    return UnsafeRootError(
        f"{path} is {what} (mode {mode:04o}); refusing it: check that nothing in it was "
        f"changed, then {fix} {path}"
    )


def _check_folder(path: Path, st: os.stat_result, *, private: bool) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        fix = "chmod 700" if private else "chmod go-w"
        raise _too_loose(path, mode, "writable by group or others", fix)


def _check_file(path: Path, st: os.stat_result, secret: bool) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafeRootError(
            f"{path} is owned by uid {st.st_uid}, not by us ({os.geteuid()}); refusing it: "
            f"check it, then chown {os.geteuid()} {path}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise _too_loose(path, mode, "writable by group or others", "chmod go-w")
    if secret and mode & 0o044:
        raise UnsafeRootError(
            f"{path} is readable by group or others (mode {mode:04o}) and holds secrets; "
            f"refusing it: chmod 600 {path} (and treat what it holds as seen by others)"
        )


def _check_tree(directory_fd: int, where: Path, *, top: bool, private: bool) -> None:
    """Refuse a symlink, or a folder or file not ours or too loose, below ``directory_fd``.

    Entries that vanish while we look (a running node renames its temporary
    files into place) are skipped: what replaced them was written by us.
    """
    with os.scandir(directory_fd) as entries:
        for entry in entries:
            path = where / entry.name
            try:
                st = os.stat(entry.name, dir_fd=directory_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeRootError(
                    f"{path} is a symbolic link; refusing it (a node root holds none: "
                    "put the real file or folder there)"
                )
            inner_private = private or (top and entry.name in _PRIVATE_TOP)
            if stat.S_ISDIR(st.st_mode):
                try:
                    fd = _open_dir(entry.name, path, dir_fd=directory_fd)
                except LocalStorageError:
                    if not os.path.lexists(path):
                        continue
                    raise
                try:
                    _check_folder(path, os.fstat(fd), private=inner_private)
                    _check_tree(fd, path, top=False, private=inner_private)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                _check_file(path, st, inner_private or entry.name in _SECRET_FILES)
            # Sockets (etcd's, under the owner-only ephemeral/) are not read.


def _check_ancestors(path: Path) -> None:
    """Refuse a folder above ``path`` that another user could move ``path`` out of."""
    for parent in path.absolute().parents:
        st = os.stat(parent)
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafeRootError(
                f"{parent}, above the node root {path}, is owned by uid {st.st_uid}, who could "
                "put another root in its place; refusing it: keep node roots in folders "
                "owned by us or by root"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise UnsafeRootError(
                f"{parent}, above the node root {path}, is writable by group or others "
                f"(mode {mode:04o}) without the sticky bit: they could put another root in "
                f"its place; refusing it: chmod go-w {parent}, or keep the root elsewhere"
            )


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
        _check_ancestors(self.path)
        root = _open_dir(self.path, self.path)
        try:
            mode = stat.S_IMODE(os.fstat(root).st_mode)
            if mode & 0o022:
                raise _too_loose(self.path, mode, "writable by group or others", "chmod go-w")
            _check_tree(root, self.path, top=True, private=False)
        finally:
            os.close(root)

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
        root = _open_dir(self.path, self.path)
        try:
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
