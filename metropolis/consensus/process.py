"""One etcd server process: its command line, its logs, its lifetime.

:func:`run_etcd` is the only place that starts the ``etcd`` binary of a
member, or takes over the one ``node recover`` started ahead for the same
command line (:mod:`.child`). It owns the child process for exactly as long
as it runs::

    run_etcd ──spawn (or take over)──> etcd (cwd = working_dir)
        │                 ├─ client socket  <working_dir>/client.sock:0
        │                 └─ stdout+stderr: zap JSON lines ──> logger (one record each)
        ├─ poll the socket until etcd answers ──> task_status.started()
        └─ wait: etcd exits  -> EtcdExited
                 cancelled   -> SIGTERM, up to 5 s grace, SIGKILL  (shielded)

Invariant: when :func:`run_etcd` returns or raises, the process has exited
and been reaped, whatever the reason (cancellation included); the stop is
shielded from cancellation so that no etcd can outlive its owner and keep
the data directory and ports busy.

And when the owner itself dies without running any cleanup (SIGKILL, OOM),
etcd dies with it: it runs under ``setpriv --pdeathsig KILL``, so the
kernel sends it SIGKILL when the thread that spawned it exits. That is why
etcd is spawned from the Trio thread itself and not through
``trio.run_process`` / ``trio.lowlevel.open_process``, which fork in a
worker thread: Trio ends idle worker threads after a few seconds, and with
them the etcd.

etcd 3.4 only accepts a UNIX client socket spelt ``unix://NAME:0``, relative
to its working directory, and creates a file literally called ``NAME:0``. A
socket file left by a killed etcd makes the next start fail, so it is
unlinked before every start.

The command line itself is :class:`~.commandline.ProcessConfig`'s.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import trio

from metropolis.consensus.child import STOP_GRACE, EtcdChild, prepare_working_dir, take_ahead
from metropolis.consensus.client import Client, EndpointStatus, EtcdError
from metropolis.consensus.commandline import ETCD_BINARY_ENV, PeerTLS, ProcessConfig
from metropolis.consensus.settings import SOCKET_NAME, SOCKET_PATH_MAX, Tuning
from metropolis.errors import ConsensusError

__all__ = [
    "ETCD_BINARY_ENV",
    "SOCKET_NAME",
    "SOCKET_PATH_MAX",
    "EtcdExited",
    "PeerTLS",
    "ProcessConfig",
    "Tuning",
    "run_etcd",
]

_READY_POLL = 0.02

#: What etcd 3.4 logs once its server runs (raft started, peer and client
#: listeners served): from here a member waits for an election or its peers,
#: nearly idle, until it answers.
_SERVER_STARTED = "now serving peer/client/metrics"
#: What etcd 3.4 logs when it applies the promotion of a learner to a voter
#: (the line does not say whose).
_PROMOTED = "promote member"
#: What etcd 3.4 logs when a stream to a peer comes up (the line names the
#: peer): on the raft leader, the first sign that a new learner runs.
_PEER_ACTIVE = "peer became active"

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "dpanic": logging.CRITICAL,
    "panic": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


class EtcdExited(ConsensusError):
    """The etcd process exited on its own (crash, kill, bad flags, lost data dir).

    ``fatal`` is the message of the last line etcd logged at a fatal or
    panic level before it exited ("" if none): it says why etcd gave up.
    """

    def __init__(self, returncode: int, fatal: str = "") -> None:
        why = f": {fatal}" if fatal else ""
        super().__init__(f"etcd exited with status {returncode}{why}")
        self.returncode = returncode
        self.fatal = fatal


async def run_etcd(
    config: ProcessConfig,
    logger: logging.Logger,
    *,
    task_status: trio.TaskStatus[EndpointStatus] = trio.TASK_STATUS_IGNORED,
    server_started: trio.Event | None = None,
    on_promotion: Callable[[], None] | None = None,
    on_peer_active: Callable[[], None] | None = None,
) -> None:
    """Run etcd until it exits or this call is cancelled.

    Calls ``task_status.started(status)`` once etcd answers on its client
    socket, with that first answer (so ``await nursery.start(run_etcd, ...)``
    returns a usable member, and what it says about itself).
    ``server_started`` is set once etcd logs that its server runs, or at
    the latest when it answers: what else a caller wants done while etcd
    starts goes best after it, when etcd waits (for an election, for its
    peers) instead of starting up on the same cores and disk.
    ``on_promotion`` is called at each line saying that etcd applied the
    promotion of a learner, any member's (a joining member replays earlier
    ones too): a hint to look at the member's status, not a fact.
    ``on_peer_active`` is called at each line saying that a stream to a
    peer came up (any peer's, also a voter's that reconnects): a hint that
    a learner may now catch up, not a fact.
    Never returns normally: raises :class:`EtcdExited` when the process
    exits, before or after becoming ready. On cancellation the process is
    stopped (SIGTERM, then SIGKILL after a grace period) before the
    cancellation propagates. Every line etcd prints is logged to ``logger``
    (zap JSON lines at their own level, anything else at INFO).
    """
    process = take_ahead(config)
    if process is None:
        prepare_working_dir(config)
        argv = config.argv()
        logger.info("starting etcd: %s", " ".join(argv))
        process = EtcdChild.spawn(argv, config.working_dir)
    else:
        logger.info("taking over etcd started ahead (pid %d)", process.pid)
    fatal: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            started = server_started if server_started is not None else trio.Event()
            hooks = {
                _SERVER_STARTED: started.set,
                _PROMOTED: on_promotion or _ignore,
                _PEER_ACTIVE: on_peer_active or _ignore,
            }
            nursery.start_soon(_pump_logs, process.output, logger, fatal, hooks)
            async with trio.open_nursery() as waiters:
                waiters.start_soon(_report_ready, config.socket_path, process, task_status, started)
                returncode = await process.wait()
                waiters.cancel_scope.cancel()
            # The last lines usually say why etcd died: give them a moment to
            # reach the log, then stop reading (a grandchild could hold the pipe).
            nursery.cancel_scope.deadline = trio.current_time() + 1.0
    finally:
        await _stop(process, logger)
        with trio.CancelScope(shield=True):
            await process.output.aclose()
    raise EtcdExited(returncode, fatal[-1] if fatal else "")


async def _report_ready(
    socket: Path,
    process: EtcdChild,
    task_status: trio.TaskStatus[EndpointStatus],
    server_started: trio.Event,
) -> None:
    async with Client(socket, timeout=2.0) as client:
        while process.returncode is None:
            try:
                status = await client.status()
            except EtcdError:
                await trio.sleep(_READY_POLL)
                continue
            server_started.set()  # also if its log line was missed
            task_status.started(status)
            return


async def _stop(process: EtcdChild, logger: logging.Logger) -> None:
    """Terminate and reap ``process``; shielded, so it also runs during cancellation."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            # SIGTERM lets a leader hand over leadership before going, which
            # spares the rest of the cluster an election timeout.
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE):
                await process.wait()
            if process.returncode is None:
                logger.warning("etcd did not stop within %.0fs, killing it", STOP_GRACE)
                process.send_signal(signal.SIGKILL)
        await process.wait()


async def _pump_logs(
    stream: trio.abc.ReceiveStream,
    logger: logging.Logger,
    fatal: list[str],
    hooks: dict[str, Callable[[], None]],
) -> None:
    """Turn etcd's zap JSON lines into log records at the matching level, until EOF.

    The messages of fatal and panic lines are appended to ``fatal``; at
    each line whose message is one of :data:`_MARKERS`, its hook in
    ``hooks`` (if any) is called.
    """
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            message = _log_line(line, logger, fatal)
            hook = hooks.get(message) if message else None
            if hook is not None:
                hook()
    if buffer:
        _log_line(buffer, logger, fatal)


def _ignore() -> None:
    pass


#: How zap spells the levels below WARNING (its JSON starts with the level).
_QUIET_LEVELS = (b'{"level":"info"', b'{"level":"debug"')
#: The messages looked for in lines that are not decoded, as zap writes them.
_MARKERS = tuple(
    (b'"msg":"' + m.encode() + b'"', m) for m in (_SERVER_STARTED, _PROMOTED, _PEER_ACTIVE)
)


def _log_line(line: bytes, logger: logging.Logger, fatal: list[str]) -> str:
    """Log one line of etcd's; return its message ("" if none).

    Lines below WARNING that ``logger`` would drop are not decoded: their
    message is "" except for those of :data:`_MARKERS`, found by their bytes.
    """
    # A joining etcd logs a few hundred info lines while it replays the
    # cluster's history, each decoded here on the Trio thread, which the
    # node's own start competes for. Fatal and panic lines never match the
    # quiet levels, so ``fatal`` misses none.
    if line.lstrip().startswith(_QUIET_LEVELS) and not logger.isEnabledFor(logging.INFO):
        return next((message for raw, message in _MARKERS if raw in line), "")
    text = line.decode(errors="replace").strip()
    if not text:
        return ""
    try:
        entry = json.loads(text)
    except ValueError:
        logger.info("%s", text)
        return ""
    if not isinstance(entry, dict):
        logger.info("%s", text)
        return ""
    level = _LEVELS.get(str(entry.pop("level", "info")), logging.INFO)
    message = str(entry.pop("msg", ""))
    if level >= logging.CRITICAL:
        fatal.append(message)
    for noise in ("ts", "caller"):
        entry.pop(noise, None)
    details = " ".join(f"{k}={v}" for k, v in entry.items())
    logger.log(level, "%s %s", message, details)
    return message
