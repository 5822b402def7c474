"""Several agent-server processes on one port, kept running.

Why processes: a heartbeat costs the server a few hundred microseconds of
CPU, nearly all of it Python (HTTP framing, the session check, the Trio
scheduling around both), and one Python process runs on one core at a
time. N worker processes (default: as many as there are CPUs) each run
the whole server (`shepherd.agent_server.server.run_agent_server`:
listener, BMDB connection pool and session, group commit) and share
nothing but the port, the BMDB and the agent session secret, which the
supervisor makes and writes to each worker's stdin (so that a session one
worker issued is accepted by all, also by a restarted one).

Why SO_REUSEPORT: each worker listens on its own socket, bound to the same
port, and the kernel spreads new connections among them (by a hash of the
connection's addresses), with no process that accepts for the others. The
supervisor first binds a socket of its own to the port with SO_REUSEPORT
without listening on it: a port 0 thus becomes one concrete port every
worker then binds, and the port stays reserved while a worker restarts
(a socket that does not listen gets no connections).

A worker that exits (crashed, killed) is started again after a wait that
grows while it keeps exiting soon after its start (`RESTART_BACKOFF`,
jittered, so that workers that failed together do not restart together)
and starts over once it ran `STABLE_RUN` seconds.
Heartbeats it acknowledged are in the BMDB already (answers follow the
commit, see `shepherd.agent_server.service`); those it had not answered
are retried by their agents, like after a server restart. Connections
waiting in its accept queue when it died are reset, and retried too.

Workers run in their own process group, so that a terminal's Ctrl-C
reaches the supervisor only; it stops them with SIGTERM (SIGKILL after
`STOP_TIMEOUT`). A worker whose supervisor is gone stops by itself
(`watch_parent`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

import trio

from common.backoff import ExponentialBackoff, Retrier
from common.listen import split_listen

logger = logging.getLogger("shepherd.agent_server.workers")

#: Seconds a worker gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT = 10.0
#: Waits between a worker's exit and its restart, seconds.
RESTART_BACKOFF = ExponentialBackoff(1.0, 30.0, jitter=(0.75, 1.25))
#: Seconds a worker must have run for its next restart to wait the shortest.
STABLE_RUN = 60.0


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    return len(os.sched_getaffinity(0)) or 1


def reserve_port(listen: str) -> tuple[socket.socket, str]:
    """A bound, not listening SO_REUSEPORT socket for ``listen``, and its concrete HOST:PORT.

    Raises OSError if the address cannot be bound (also: taken by a
    process that did not set SO_REUSEPORT).
    """
    host, port = split_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    return sock, (f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}")


async def supervise(
    worker_argv: Sequence[str],
    listen: str,
    count: int,
    *,
    secret: bytes | None = None,
    image_listen: str | None = None,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``count`` workers on ``listen`` until cancelled; ``task_status`` gets HOST:PORT.

    Each worker is ``python -m shepherd.agent_server`` with ``worker_argv``
    and ``--listen HOST:PORT --reuse-port``; ``secret``, if given, is
    written (hex, one line) to its stdin: the agent session secret all of
    them share, also a restarted one. Cancelled, it stops them all (under a
    shield, bounded by `STOP_TIMEOUT`). ``image_listen``, if given, is
    reserved the same way and every worker serves images there too
    (``--image-listen``). Raises OSError if an address cannot be bound.
    ``rng`` jitters the restart waits.
    """
    rng = rng if rng is not None else random.Random()
    reserved, bound = reserve_port(listen)
    image: tuple[socket.socket, str] | None = None
    try:
        argv = [
            sys.executable,
            "-m",
            "shepherd.agent_server",
            *worker_argv,
            "--listen",
            bound,
            "--reuse-port",
        ]
        if image_listen is not None:
            image = reserve_port(image_listen)
            argv += ["--image-listen", image[1]]
        async with trio.open_nursery() as nursery:
            for index in range(count):
                retrier = Retrier(RESTART_BACKOFF, random.Random(rng.getrandbits(64)))
                nursery.start_soon(_keep_running, index, argv, secret, retrier)
            logger.info(
                "%d workers on %s%s", count, bound, f", images on {image[1]}" if image else ""
            )
            task_status.started(bound)
    finally:
        reserved.close()
        if image is not None:
            image[0].close()


async def _keep_running(
    index: int, argv: list[str], secret: bytes | None, retrier: Retrier
) -> None:
    while True:
        started_at = trio.current_time()
        process = await trio.lowlevel.open_process(
            argv, start_new_session=True, stdin=subprocess.PIPE if secret is not None else None
        )
        logger.info("worker %d started (pid %d)", index, process.pid)
        try:
            if process.stdin is not None and secret is not None:
                # A worker that died at once: its exit is logged and it is restarted.
                with contextlib.suppress(trio.BrokenResourceError):
                    await process.stdin.send_all(secret.hex().encode() + b"\n")
                await process.stdin.aclose()
            status = await process.wait()
        finally:
            if process.returncode is None:  # cancelled: stop it
                with trio.CancelScope(shield=True):
                    process.send_signal(signal.SIGTERM)
                    with trio.move_on_after(STOP_TIMEOUT):
                        await process.wait()
                    if process.returncode is None:
                        logger.warning("worker %d did not stop, killing it", index)
                        process.kill()
                        await process.wait()
        if trio.current_time() - started_at >= STABLE_RUN:
            retrier.reset()
        delay = retrier.next_delay()
        logger.warning(
            "worker %d (pid %d) exited with status %s, restarting in %.1fs",
            index,
            process.pid,
            status,
            delay,
        )
        await trio.sleep(delay)


async def watch_parent(cancel_scope: trio.CancelScope, interval: float = 1.0) -> None:
    """Cancel ``cancel_scope`` once this process's parent is gone (re-parented)."""
    parent = os.getppid()
    # Polled: the kernel signals nothing when a parent exits (without prctl).
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(interval)
    logger.warning("supervisor %d is gone, stopping", parent)
    cancel_scope.cancel()
