"""A new one-member etcd data directory from a snapshot, by etcd's own ``etcdctl``.

:func:`start_restore` starts ``etcdctl snapshot restore`` (etcd's proven
tool: it rebuilds the keyspace from the snapshot's bbolt database, drops
the old membership and writes a new single-member cluster with a new
cluster ID) into a folder beside the target, so that the target is not
touched until etcd's tool succeeded; :meth:`Restore.finish` puts its
result in place. No hand-written raft surgery: what the restored member
holds is what etcd itself would restore. etcd 3.4's restore writes no keys
of its own choosing (its flags name the member, its peer URLs, the
cluster token and the folders only).

Neither Trio nor any event loop is needed: ``node recover`` starts etcdctl
before it imports them, and waits for :attr:`Restore.exited` (a pidfd,
readable once etcdctl exited) with its loop. The binary is
``$METROPOLIS_ETCDCTL_BINARY`` or ``etcdctl`` on PATH (Debian
``etcd-client``). Errors: :class:`RestoreError` with one line naming what
etcdctl said; :meth:`Restore.abort` kills etcdctl and removes the
half-written folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from metropolis.errors import ConsensusError

__all__ = ["ETCDCTL_BINARY_ENV", "Restore", "RestoreError", "etcdctl", "start_restore"]

#: Names the etcdctl binary; unset or empty, ``etcdctl`` is looked up on PATH.
ETCDCTL_BINARY_ENV = "METROPOLIS_ETCDCTL_BINARY"


class RestoreError(ConsensusError):
    """etcd's restore tool refused the snapshot or could not run."""


def etcdctl() -> str:
    """The etcdctl binary to run."""
    return os.environ.get(ETCDCTL_BINARY_ENV) or "etcdctl"


class Restore:
    """``etcdctl snapshot restore`` running (see :func:`start_restore`).

    Blocking methods; each is safe to call again, and :meth:`abort` after
    :meth:`finish` does nothing.
    """

    def __init__(
        self,
        snapshot: Path,
        target: Path,
        tmp: Path,
        process: subprocess.Popen[bytes],
        output: IO[bytes],
    ) -> None:
        self._snapshot = snapshot
        self._target = target
        self._tmp = tmp
        self._process = process
        self._output = output
        # Until the process is reaped its pid cannot be reused, so this is
        # etcdctl's for as long as it is open.
        self._pidfd = os.pidfd_open(process.pid)
        self._done = False

    @property
    def exited(self) -> int:
        """A file descriptor that is readable once etcdctl exited (a pidfd)."""
        return self._pidfd

    def finish(self) -> None:
        """Wait for etcdctl; put its result at the target (see :func:`start_restore`).

        :class:`RestoreError` if etcdctl failed; its folder is removed either way.
        """
        if self._done:
            return
        try:
            returncode = self._process.wait()
            if returncode != 0:
                self._output.seek(0)
                lines = self._output.read().decode(errors="replace").strip().splitlines()
                why = lines[-1] if lines else f"status {returncode}"
                raise RestoreError(f"etcdctl snapshot restore {self._snapshot}: {why}")
            _publish(self._tmp, self._target)
        finally:
            self._close()

    def abort(self) -> None:
        """Kill etcdctl if it still runs, reap it and remove its folder."""
        if self._done:
            return
        try:
            if self._process.poll() is None:
                self._process.send_signal(signal.SIGKILL)
            self._process.wait()
        finally:
            self._close()

    def _close(self) -> None:
        self._done = True
        os.close(self._pidfd)
        self._output.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def start_restore(snapshot: Path, target: Path, *, name: str, peer_url: str) -> Restore:
    """Start restoring ``snapshot`` into the new data directory ``target`` (which must not
    exist); blocking, for the fork only.

    The member is called ``name`` and advertises ``peer_url``; it is the
    only member of its cluster. The data is built in ``target`` + ``.tmp``
    and renamed into place (then the parent folder fsynced) by
    :meth:`Restore.finish` only once etcdctl succeeded, so ``target`` is
    whole or absent; its folders and files are owner-only. :class:`RestoreError`
    if ``target`` exists or etcdctl cannot be started.
    """
    if target.exists():
        raise RestoreError(f"{target} exists: restore into a new folder")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    argv = [
        etcdctl(),
        "snapshot",
        "restore",
        str(snapshot),
        f"--name={name}",
        f"--initial-cluster={name}={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        "--initial-cluster-token=metropolis",
        f"--data-dir={tmp}",
    ]
    # Its output goes to an unnamed file, read once it exited: a pipe left
    # unread while waiting could fill and stop it.
    output = tempfile.TemporaryFile()  # noqa: SIM115 (Restore closes it)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
    except OSError as e:
        output.close()
        raise RestoreError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    return Restore(snapshot, target, tmp, process, output)


def _publish(tmp: Path, target: Path) -> None:
    # etcdctl writes some files readable by all (0644); they hold the whole
    # cluster's state, its keys included: owner-only, as etcd makes its own.
    for directory, _, files in os.walk(tmp):
        os.chmod(directory, 0o700)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o600)
    os.replace(tmp, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
