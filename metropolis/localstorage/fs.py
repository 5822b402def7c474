"""Folders and reads that never follow a symlink nor trust a folder not ours.

Everything goes through descriptors opened with ``O_NOFOLLOW``: no path is
resolved twice, so nothing can be swapped for a symlink between a check and
its use.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from metropolis.localstorage.errors import LocalStorageError, UnsafeRootError

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "dir_at",
    "make_private_dir",
    "open_dir",
    "read_file",
]

#: Private directories and files: the node's secrets live here.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(name: str | Path, where: Path, dir_fd: int | None = None) -> int:
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


def dir_at(parent_fd: int, name: str, mode: int, where: Path) -> int:
    """Create (or open) ``name`` in ``parent_fd`` with exactly ``mode``; its descriptor.

    Everything through descriptors: no path is resolved twice, so nothing
    can be swapped for a symlink between the check and the chmod. mkdir's
    mode is filtered by the umask and not applied to existing directories,
    hence the explicit fchmod (a directory left 0755 by an older layout
    would otherwise keep leaking file names).
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=parent_fd)
    fd = open_dir(name, where, dir_fd=parent_fd)
    os.fchmod(fd, mode)
    return fd


def make_private_dir(path: Path) -> None:
    # Parents are the caller's business (a Root checks its own tree); the
    # directory itself must be a real, owned, private one.
    path.parent.mkdir(parents=True, exist_ok=True)
    parent = open_dir(path.parent, path.parent)
    try:
        os.close(dir_at(parent, path.name, PRIVATE_DIR_MODE, path))
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
