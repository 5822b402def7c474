"""A new one-member etcd data directory from a snapshot, by etcd's own ``etcdctl``.

:func:`restore_data` runs ``etcdctl snapshot restore`` (etcd's proven
tool: it rebuilds the keyspace from the snapshot's bbolt database, drops
the old membership and writes a new single-member cluster with a new
cluster ID) into a folder beside the target, so that the target is not
touched until etcd's tool succeeded. No hand-written raft surgery: what
the restored member holds is what etcd itself would restore.

The binary is ``$METROPOLIS_ETCDCTL_BINARY`` or ``etcdctl`` on PATH
(Debian ``etcd-client``). Cancellation: the child is killed and the
half-written folder removed. Errors: :class:`RestoreError` with one line
naming what etcdctl said.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import trio

from metropolis.errors import ConsensusError

__all__ = ["ETCDCTL_BINARY_ENV", "RestoreError", "restore_data"]

#: Names the etcdctl binary; unset or empty, ``etcdctl`` is looked up on PATH.
ETCDCTL_BINARY_ENV = "METROPOLIS_ETCDCTL_BINARY"


class RestoreError(ConsensusError):
    """etcd's restore tool refused the snapshot or could not run."""


def etcdctl() -> str:
    """The etcdctl binary to run."""
    return os.environ.get(ETCDCTL_BINARY_ENV) or "etcdctl"


async def restore_data(snapshot: Path, target: Path, *, name: str, peer_url: str) -> None:
    """Restore ``snapshot`` into the new data directory ``target`` (which must not exist).

    The member is called ``name`` and advertises ``peer_url``; it is the
    only member of its cluster. The data is built in ``target`` + ``.tmp``
    and renamed into place (then the parent folder fsynced) only once
    etcdctl succeeded, so ``target`` is whole or absent; its folders and
    files are owner-only.
    """
    if await trio.Path(target).exists():
        raise RestoreError(f"{target} exists: restore into a new folder")
    tmp = target.with_name(target.name + ".tmp")
    await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
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
    try:
        try:
            done = await trio.run_process(
                argv,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env={**os.environ, "ETCDCTL_API": "3"},
            )
        except OSError as e:
            raise RestoreError(f"cannot run {argv[0]}: {e.strerror or e}") from None
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"status {done.returncode}"
            raise RestoreError(f"etcdctl snapshot restore {snapshot}: {why}")
        await trio.to_thread.run_sync(_publish, tmp, target)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, tmp, True)


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
