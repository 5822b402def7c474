"""The etcd child process, and one started ahead of the service that runs it.

:class:`EtcdChild` is the process :func:`~.process.run_etcd` owns: spawned
from the Trio thread under ``setpriv --pdeathsig KILL`` (see that module
for why), its output on one pipe, awaited through a pidfd.

A node started by ``node recover`` knows its etcd's command line as soon
as the restored data is in place, well before the rest of the node is
imported and its consensus service reaches the point of starting etcd. etcd
needs that time for its own start and its first election, so the command
starts it *ahead* (:func:`start_ahead`) and the service takes it over
(:func:`take_ahead`, called by :func:`~.process.run_etcd`)::

    node recover ── data in place ── start_ahead(config) ──> etcd runs,
        │                                                    its output
        │  (imports, the role server, the consensus          buffered in
        │   service deciding to run this member)             its pipe
        ▼
    run_etcd(config) ── take_ahead(config): the same command line?
        ├─ yes: this process is the member; its output read from the start
        └─ no:  it is stopped, and run_etcd starts its own

Invariants relied on:

- At most one etcd waits to be taken over in a process; it is taken over
  at most once, and only by a :func:`~.process.run_etcd` of the same
  command line (argv, working directory), which then owns it as if it had
  started it.
- One not taken over never outlives its starter: it is stopped by
  :func:`stop_ahead` (the command calls it when the node stops) or, at the
  latest, killed by the kernel when the thread that started it exits.
- Starting one ahead imports neither Trio nor etcd's client: ``node
  recover`` does it on its main thread while another imports them.
- Its output is read by nobody until it is taken over: etcd blocks on a
  full pipe (64 KiB, some hundreds of log lines) and goes on once read.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from metropolis.consensus.commandline import ProcessConfig
from metropolis.consensus.etcderrors import check_socket_path

if TYPE_CHECKING:
    import trio

__all__ = ["STOP_GRACE", "EtcdChild", "start_ahead", "stop_ahead", "take_ahead"]

_log = logging.getLogger("metropolis.consensus.child")

#: How long a stop waits after SIGTERM before it kills (:func:`stop_ahead`,
#: and :func:`~.process.run_etcd` on cancellation).
STOP_GRACE = 5.0


class EtcdChild:
    """The etcd process: a Popen spawned from the Trio thread, awaited through a pidfd."""

    def __init__(self, popen: subprocess.Popen[bytes], output_fd: int) -> None:
        self._popen = popen
        self._output_fd = output_fd
        self._output: trio.lowlevel.FdStream | None = None
        self._pidfd = os.pidfd_open(popen.pid)

    @property
    def output(self) -> trio.lowlevel.FdStream:
        """The read end of etcd's stdout and stderr, for its owner's Trio loop."""
        import trio  # on first use: start_ahead runs before Trio is imported

        if self._output is None:
            self._output = trio.lowlevel.FdStream(self._output_fd)
        return self._output

    def close_unread(self) -> None:
        """Close the output's read end, never read through :attr:`output` (blocking)."""
        if self._output is None and self._output_fd >= 0:
            os.close(self._output_fd)
            self._output_fd = -1

    @classmethod
    def spawn(cls, argv: list[str], cwd: Path) -> EtcdChild:
        """Start ``argv`` in ``cwd``; it gets SIGKILL when this thread exits.

        Blocks the calling thread for the fork (milliseconds); see
        :mod:`.process` for why it must be the Trio thread.
        """
        read_end, write_end = os.pipe()
        try:
            popen = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", *argv],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                # One pipe for both: zap logs go to stderr, but nothing etcd
                # prints (a Go panic, a flag error) may be lost.
                stdout=write_end,
                stderr=write_end,
                # Not in our process group: Ctrl-C in a terminal signals the
                # whole foreground group, and etcd must stop when we stop it
                # (after the services that use it), not on its own.
                start_new_session=True,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return cls(popen, read_end)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait until the process exits and reap it; return its exit status."""
        import trio

        if self._popen.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
        return self._reap()

    def wait_blocking(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds (blocking) for the process to exit and
        reap it; its exit status, or None if it still runs."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self._reap()

    def _reap(self) -> int:
        returncode = self._popen.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return returncode

    def send_signal(self, sig: signal.Signals) -> None:
        # Until wait() reaped it, the pid cannot have been reused.
        if self._popen.returncode is None:
            self._popen.send_signal(sig)


#: The etcd started ahead and not yet taken over: its command line (argv
#: and working directory) and the process.
_ahead: tuple[list[str], Path, EtcdChild] | None = None


def start_ahead(config: ProcessConfig) -> int:
    """Start the etcd of ``config`` for a later :func:`~.process.run_etcd` of
    the same config to take over; its pid.

    Blocking (the fork, milliseconds); call it from the thread that will
    run the node's Trio loop (the main thread), for the process to die
    with it. Prepares the working directory as ``run_etcd`` does. Raises
    :class:`RuntimeError` if one was started ahead and not taken over, and
    :class:`OSError` if etcd cannot be started.
    """
    global _ahead
    if _ahead is not None:
        raise RuntimeError("an etcd started ahead was not taken over yet")
    prepare_working_dir(config)
    argv = config.argv()
    child = EtcdChild.spawn(argv, config.working_dir)
    _ahead = (argv, config.working_dir, child)
    _log.info("started etcd ahead of the node (pid %d): %s", child.pid, " ".join(argv))
    return child.pid


def take_ahead(config: ProcessConfig) -> EtcdChild | None:
    """The etcd started ahead with ``config``'s command line, now the caller's
    to own; None if there is none (a differing one is stopped first, blocking).

    An etcd started ahead that has already exited is handed over all the
    same: its owner reads its output and reaps it as for any other.
    """
    global _ahead
    if _ahead is None:
        return None
    argv, cwd, child = _ahead
    if argv == config.argv() and cwd == config.working_dir:
        _ahead = None
        return child
    _log.warning("the etcd started ahead has another command line: stopping it")
    stop_ahead()
    return None


def stop_ahead() -> None:
    """Stop the etcd started ahead, if one was not taken over (blocking):
    SIGTERM, then SIGKILL after a grace period; reaped either way."""
    global _ahead
    if _ahead is None:
        return
    _, _, child = _ahead
    _ahead = None
    child.send_signal(signal.SIGTERM)
    if child.wait_blocking(STOP_GRACE) is None:
        _log.warning("the etcd started ahead did not stop within %.0fs, killing it", STOP_GRACE)
        child.send_signal(signal.SIGKILL)
        child.wait_blocking(STOP_GRACE)
    child.close_unread()


def prepare_working_dir(config: ProcessConfig) -> None:
    """Make etcd's working directory, and remove a socket file a killed etcd
    left there (etcd 3.4 would fail to listen on it).

    Raises :class:`~.etcderrors.SocketPathTooLong` when the client socket's
    path is too long for a UNIX socket.
    """
    check_socket_path(config.socket_path)
    config.working_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    config.socket_path.unlink(missing_ok=True)
