"""A real etcd on loopback, for the tests and the benchmarks.

`EtcdServer` is a single member started through the same
`metropolis.consensus.process.run_etcd` as the consensus service, with
plain-HTTP peers on a free loopback port and the fast `LOOPBACK_TUNING`.
`etcd_pid` and `kill_etcd` find and crash an etcd that some service
started, without that service exposing the process.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import trio

from common.net import free_loopback_port
from metropolis.consensus.client import EndpointStatus
from metropolis.consensus.process import EtcdExited, ProcessConfig, Tuning, run_etcd

__all__ = ["LOOPBACK_TUNING", "EtcdServer", "etcd_pid", "kill_etcd"]

#: Raft timing for loopback clusters: heartbeats and elections five times
#: sooner than etcd's defaults, so a member starts and elects sooner.
LOOPBACK_TUNING = Tuning(heartbeat_ms=20, election_ms=200)


class EtcdServer:
    """One etcd process that can be stopped, SIGKILLed and started again on
    the same data (how the tests exercise reconnects). It runs as a task of
    ``nursery``; cancelling that nursery stops it."""

    def __init__(self, directory: Path, nursery: trio.Nursery) -> None:
        self.config = ProcessConfig.standalone(
            "test", directory, free_loopback_port(), LOOPBACK_TUNING
        )
        self._nursery = nursery
        self._scope: trio.CancelScope | None = None
        self._exited = trio.Event()
        self._pid: int | None = None

    @property
    def socket_path(self) -> Path:
        return self.config.socket_path

    async def start(self) -> None:
        """Start etcd and wait until it answers on its socket."""
        assert self._scope is None, "already running"
        self._exited = trio.Event()
        self._scope = trio.CancelScope()
        await self._nursery.start(self._run, self._scope)

    async def _run(
        self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[EndpointStatus]
    ) -> None:
        logger = logging.getLogger("metropolis.consensus.localetcd")
        try:
            with scope:
                await run_etcd(self.config, logger, task_status=task_status)
        except EtcdExited as e:
            logger.info("local etcd ended: %s", e)
        finally:
            self._exited.set()

    async def stop(self) -> None:
        """Stop etcd (SIGTERM) and wait until it has exited."""
        if self._scope is not None:
            self._scope.cancel()
            await self._exited.wait()
            self._scope = None

    async def kill(self) -> None:
        """SIGKILL etcd, as a crash would, and wait until it is reaped."""
        assert self._scope is not None, "not running"
        kill_etcd(self.config.working_dir)
        await self._exited.wait()
        self._scope = None


def etcd_pid(working_dir: Path) -> int | None:
    """The pid of the etcd process running in ``working_dir``, if any (found via /proc)."""
    cwd = working_dir.resolve()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() == "etcd" and (proc / "cwd").resolve() == cwd:
                return int(proc.name)
        except OSError:
            continue  # exited while we looked
    return None


def kill_etcd(working_dir: Path, sig: signal.Signals = signal.SIGKILL) -> int:
    """Send ``sig`` (SIGKILL: as a crash would) to the etcd process running in
    ``working_dir``; return its pid. Raises `ProcessLookupError` if none runs there.

    Lets tests crash an etcd that some service started without that service
    exposing the process.
    """
    pid = etcd_pid(working_dir)
    if pid is None:
        raise ProcessLookupError(f"no etcd process runs in {working_dir}")
    os.kill(pid, sig)
    return pid
