"""The machines' Debian 12 root, built once with ``mmdebstrap`` and cached.

`ensure_root` returns a `RootImage`: a tarball built by::

    mmdebstrap --variant=apt --include=systemd,systemd-sysv,openssh-server,... bookworm ROOT.tar

and the same tree extracted beside it (the read-only lower layer of every
machine's overlay, `shepherd.nspawn.machine`). Both live in
``<cache>/<key>/``, where the key is a digest of everything the build is
asked for (suite, variant, package list, hook commands, format version): a
change to any of them is a new folder, the same request reuses the old one.

A cache entry is used only when complete: the tarball and the tree are made
under temporary names and renamed into place (the tree last), so a build cut
by a crash or Ctrl-C leaves only a temporary name, which the next build
removes. Builders of one key take an exclusive ``flock`` on
``<cache>/<key>.lock``: a second builder, in this process or another, waits
for the first and then reuses what it left. The host's SSH host keys the
Debian package generates are removed from the image (each machine gets its
own, `shepherd.nspawn.machine`), and so is the machine id.

Blocking (runs mmdebstrap, about 25 to 95 s on a cold cache; tar): for a
thread, not a Trio task. Needs root (mmdebstrap's root mode, tar keeping
owners). Errors: `RootBuildError` with mmdebstrap's last output lines.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shepherd.errors import ShepherdError

__all__ = [
    "DEFAULT_CACHE",
    "PACKAGES",
    "RootBuildError",
    "RootImage",
    "default_cache",
    "ensure_root",
    "root_key",
]

logger = logging.getLogger("shepherd.nspawn.rootfs")

#: What every machine has: systemd as init, sshd for the Shepherd, python3
#: for the agent, and the disk tools the agent's installer runs.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "openssh-server",
    "python3",
    "fdisk",
    "e2fsprogs",
    "iproute2",
)
SUITE = "bookworm"
VARIANT = "apt"
#: Run inside the new root before it is packed ("$1" is the root).
#: Host keys and machine id would otherwise be the same on every machine.
HOOKS = ('rm -f "$1"/etc/ssh/ssh_host_*', 'rm -f "$1"/etc/machine-id "$1"/var/lib/dbus/machine-id')
#: Bumped when the layout of a cache entry changes.
_FORMAT = 1

#: The default cache folder, beside the node image cache's.
DEFAULT_CACHE = Path("~/.cache/metropolis-machines")


class RootBuildError(ShepherdError):
    """mmdebstrap (or unpacking its tarball) failed; the message has its output's tail."""


@dataclass(frozen=True)
class RootImage:
    """A finished cache entry."""

    key: str
    tarball: Path
    #: The tarball extracted (owners kept): a machine's lower layer, never written.
    tree: Path
    #: True if this call ran mmdebstrap; False if it reused the cache.
    built: bool


def default_cache() -> Path:
    return DEFAULT_CACHE.expanduser()


def _command(tarball: Path, packages: tuple[str, ...], mmdebstrap: str = "mmdebstrap") -> list[str]:
    return [
        mmdebstrap,
        f"--variant={VARIANT}",
        # Explicit: mmdebstrap guesses the format from the name, and the
        # temporary name does not end in .tar.
        "--format=tar",
        f"--include={','.join(packages)}",
        *(f"--customize-hook={hook}" for hook in HOOKS),
        SUITE,
        str(tarball),
    ]


def root_key(packages: tuple[str, ...] = PACKAGES) -> str:
    """The cache key of a root with ``packages``: a digest of the whole request."""
    request = {
        "format": _FORMAT,
        "command": _command(Path("ROOT.tar"), tuple(sorted(packages)))[1:],
    }
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:24]


def ensure_root(
    cache: Path | None = None,
    packages: tuple[str, ...] = PACKAGES,
    *,
    mmdebstrap: str = "mmdebstrap",
) -> RootImage:
    """The cached root of ``packages`` under ``cache`` (default `default_cache`),
    built first when there is none. Waits while another builder of the same
    key holds its lock. Raises `RootBuildError`; a failed build leaves the
    cache as it was (no entry)."""
    cache = default_cache() if cache is None else cache
    packages = tuple(sorted(packages))
    key = root_key(packages)
    folder = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"{key}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tarball, tree = folder / "root.tar", folder / "root"
        if tree.is_dir() and tarball.is_file():
            return RootImage(key, tarball, tree, built=False)
        folder.mkdir(exist_ok=True)
        for leftover in folder.glob(".*"):
            logger.info("removing %s, left by a build that did not finish", leftover)
            _remove(leftover)
        built = False
        if not tarball.is_file():
            partial = folder / ".root.tar.partial"
            logger.info("building the machines' root %s with mmdebstrap", key)
            result = subprocess.run(
                _command(partial, packages, mmdebstrap),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0 or not partial.is_file():
                _remove(partial)
                tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
                raise RootBuildError(f"mmdebstrap exited with {result.returncode}:\n{tail}")
            partial.rename(tarball)
            built = True
        partial_tree = folder / ".root.partial"
        partial_tree.mkdir()
        unpack = subprocess.run(
            ["tar", "-C", str(partial_tree), "--numeric-owner", "-xpf", str(tarball)],
            capture_output=True,
            text=True,
            check=False,
        )
        if unpack.returncode != 0:
            _remove(partial_tree)
            raise RootBuildError(f"cannot unpack {tarball}: {unpack.stderr.strip()[-2000:]}")
        partial_tree.rename(tree)
        return RootImage(key, tarball, tree, built=built)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    # A tree of root-owned files (setuid binaries, read-only folders) that
    # rmtree could not take is a leftover only, never used: say so.
    if os.path.lexists(path):
        logger.warning("could not remove %s completely", path)
