"""The node image unpacked once into files, so that the node starts from them, not from a zip.

The node image is a shiv zipapp (`metropolis.image.build`): run as a zip,
shiv's bootstrap extracts its ``site-packages`` into a cache at its first
start, on the node's critical path (most of a node's first start on a
loaded machine, with the bytecode compiled there too before the image
carried it). Here the image is unpacked ahead of that, into a folder of
its own named by its SHA-256, with a launcher that does what shiv's
bootstrap does once extracted (the image's packages first on
``sys.path``, then its entry point), so ``python3 FOLDER ARGS`` runs the
node as ``python3 IMAGE ARGS`` would::

    CACHE/<sha256>/site-packages/...    the image's site-packages, modes kept
                                        (etcd stays 0755), bytecode included
    CACHE/<sha256>/__main__.py          the launcher (the image's entry point)
    CACHE/<sha256>/manifest.json        each file's size, as the zip says

Who unpacks: the agent, from the image it downloaded, while it writes the
disk (`shepherd.agent.install`), so that the node's first start is as a
warm one; and ``bootprep`` at each later boot, from the image it read off
the system slot (`CACHE` is a tmpfs). A folder appears whole or not at all
(unpacked beside it, then renamed); one that does not match its manifest's
sizes (`complete`) is unpacked again. Like shiv's cache, it is no
defence against whoever can write the folder; the image itself is what
is verified, by its SHA-256, before it is unpacked (the callers check
it).

Standalone (the standard library only): the installer copies this file
beside ``bootprep.py`` on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zipfile

# zipfile is imported where it is used: the agent imports this module at
# its start (for `CACHE`), which is on the takeover's critical path.

#: Where unpacked images live on the machine: /run, a tmpfs, so that
#: unpacking writes no disk (creating some 2,000 files on the root
#: filesystem cost about three times the CPU, on a machine installing
#: beside four others, and a folder cut by a power loss cannot survive
#: it); the price is an unpacking at each boot (`bootprep`), and the
#: image's size in memory.
CACHE = "/run/metropolis/images"
_PACKAGES = "site-packages"
_MANIFEST = "manifest.json"

_LAUNCHER = """\
# Written by shepherd.agent.unpack: what shiv's bootstrap does once its
# site-packages are extracted, for the image unpacked beside this file.
import os
import site
import sys

_packages = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site-packages")
_before = list(sys.path)
site.addsitedir(_packages)
# The image's packages (and what their .pth files add) before the system's.
_added = [p for p in sys.path if p not in _before]
sys.path[:] = _added + _before
from {module} import {function} as _entry  # noqa: E402

sys.exit(_entry())
"""


class UnpackError(Exception):
    """The image cannot be unpacked (not a shiv zipapp, a file that escapes
    the folder); the message says why. Not an `AgentError`: this module
    runs alone beside the boot helper, without the agent's package."""


def tree(digest: str, cache: str = CACHE) -> str:
    """The folder the image of SHA-256 ``digest`` unpacks into."""
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise UnpackError(f"not a SHA-256 in hex: {digest[:80]!r}")
    return os.path.join(cache, digest)


def _private_folders(path: str) -> None:
    """``path`` and each missing folder above it made 0700: the boot helper
    keeps the node's parameters (its ticket) in /run/metropolis, which must
    not become readable by others because this made it first."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile
            os.mkdir(folder, 0o700)


def _entry_point(archive: zipfile.ZipFile) -> tuple[str, str]:
    try:
        environment = json.loads(archive.read("environment.json"))
        module, _, function = str(environment["entry_point"]).partition(":")
    except (KeyError, ValueError, TypeError) as exc:
        raise UnpackError(f"not a shiv zipapp with an entry point: {exc}") from None
    names = [*module.split("."), function]
    if not all(name.isidentifier() for name in names):
        raise UnpackError(f"entry point {module}:{function} is not module:function")
    return module, function


def _members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """The site-packages files, each checked to stay inside the folder."""
    members = []
    for info in archive.infolist():
        name = info.filename
        if not name.startswith(f"{_PACKAGES}/") or name.endswith("/"):
            continue
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts) or "\\" in name:
            raise UnpackError(f"member {name[:200]!r} escapes the folder")
        members.append(info)
    return members


def unpack(image: str, digest: str, cache: str = CACHE) -> str:
    """Unpack the (verified) image at ``image`` of SHA-256 ``digest`` into
    its folder under ``cache`` and return the folder; one already there is
    replaced. `UnpackError` (or OSError) if it cannot be; nothing of it is
    left then."""
    import zipfile

    target = tree(digest, cache)
    _private_folders(cache)
    work = f"{target}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    try:
        with zipfile.ZipFile(image) as archive:
            module, function = _entry_point(archive)
            sizes = {}
            made: set[str] = set()
            for info in _members(archive):
                path = os.path.join(work, info.filename)
                folder = os.path.dirname(path)
                if folder not in made:  # a syscall or more each, for every file
                    os.makedirs(folder, exist_ok=True)
                    made.add(folder)
                with archive.open(info) as src, open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(path, mode or 0o644)
                sizes[info.filename] = info.file_size
        with open(os.path.join(work, "__main__.py"), "w") as f:
            f.write(_LAUNCHER.format(module=module, function=function))
        with open(os.path.join(work, _MANIFEST), "w") as f:
            json.dump(sizes, f)
        if os.path.lexists(target):
            shutil.rmtree(target)
        os.rename(work, target)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise UnpackError(f"{image}: {exc}") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def complete(folder: str) -> bool:
    """Whether ``folder`` holds every file its manifest names, of its size,
    and the launcher (a folder cut by a power loss does not)."""
    try:
        with open(os.path.join(folder, _MANIFEST)) as f:
            sizes = json.load(f)
        if not isinstance(sizes, dict) or os.path.getsize(os.path.join(folder, "__main__.py")) < 1:
            return False
        return all(
            os.path.getsize(os.path.join(folder, str(name))) == size for name, size in sizes.items()
        )
    except (OSError, ValueError):
        return False


def ensure(image: str, digest: str, cache: str = CACHE, *, prune_others: bool = False) -> str:
    """The image's folder, unpacked from ``image`` unless it is there and
    `complete` already (a node may be running from it: it is left as it
    is); with ``prune_others``, the other images' folders under ``cache``
    removed too (`prune`). Raises as `unpack`."""
    target = tree(digest, cache)
    if not complete(target):
        unpack(image, digest, cache)
    if prune_others:
        prune(cache, keep=digest)
    return target


def prune(cache: str, *, keep: str) -> None:
    """Remove every folder under ``cache`` but the image ``keep``'s, and
    those half unpacked by a process that is gone (not one still at it)."""
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return
    for name in names:
        if name == keep:
            continue
        parts = name.split(".")
        if len(parts) == 3 and parts[2] == "tmp" and os.path.exists(f"/proc/{parts[1]}"):
            continue  # being unpacked now
        shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
