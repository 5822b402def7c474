"""Root checks: a node root, and every folder above it, only we can change.

See the package's docstring for what :meth:`~metropolis.localstorage.Root.check`
refuses and why it never changes a mode itself.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from metropolis.localstorage.errors import LocalStorageError, UnsafeRootError
from metropolis.localstorage.fs import open_dir

__all__ = ["check_root"]

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
                    fd = open_dir(entry.name, path, dir_fd=directory_fd)
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


def check_root(path: Path) -> None:
    """Refuse a node root at ``path`` that another local user could tamper with.

    What :meth:`metropolis.localstorage.Root.check` documents; reads only.
    """
    _check_ancestors(path)
    root = open_dir(path, path)
    try:
        mode = stat.S_IMODE(os.fstat(root).st_mode)
        if mode & 0o022:
            raise _too_loose(path, mode, "writable by group or others", "chmod go-w")
        _check_tree(root, path, top=True, private=False)
    finally:
        os.close(root)
