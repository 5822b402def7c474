"""One etcd server process: its command line, its logs, its lifetime.

:func:`run_etcd` is the only place that starts the ``etcd`` binary. It owns
the child process for exactly as long as it runs::

    run_etcd ──spawn──> etcd (cwd = working_dir)
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
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import trio

from metropolis.consensus.client import Client, EndpointStatus, EtcdError, check_socket_path
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

#: Names the etcd binary to run. A node image's entry point
#: (`metropolis.image.entry`) sets it to the etcd the image bundles; unset
#: or empty, ``etcd`` is looked up on PATH.
ETCD_BINARY_ENV = "METROPOLIS_ETCD_BINARY"
_STOP_GRACE = 5.0
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


@dataclass(frozen=True)
class PeerTLS:
    """Files for mutual TLS between peers: all from the consensus peer CA."""

    ca_certificate: Path
    certificate: Path
    key: Path
    #: Re-read by etcd on every new peer connection; its signature is *not*
    #: checked, so only the owner may be able to write it.
    crl: Path


@dataclass(frozen=True)
class ProcessConfig:
    """Everything an etcd command line needs."""

    name: str
    data_dir: Path
    #: etcd's working directory; the client socket is created here.
    working_dir: Path
    #: ``host:port`` on which peers connect.
    peer_address: str
    #: None only while bootstrapping the PKI: peers are then plain HTTP.
    peer_tls: PeerTLS | None
    #: Members (name -> peer URL) for ``--initial-cluster``; ignored by etcd
    #: once the data directory holds a member.
    initial_cluster: Mapping[str, str]
    cluster_state: Literal["new", "existing"]
    tuning: Tuning = field(default_factory=Tuning)
    cluster_token: str = "metropolis"

    @classmethod
    def standalone(
        cls, name: str, directory: Path, peer_port: int, tuning: Tuning
    ) -> ProcessConfig:
        """A one-member cluster without peer TLS, its files under ``directory``.

        For tools and tests that need a bare etcd; the consensus service
        builds its own configurations. ``peer_port`` must stay the same when
        the member restarts on the same data: etcd recorded the peer URL.
        """
        peer_address = f"127.0.0.1:{peer_port}"
        return cls(
            name=name,
            data_dir=directory / "data",
            working_dir=directory / "run",
            peer_address=peer_address,
            peer_tls=None,
            initial_cluster={name: f"https://{peer_address}"},
            cluster_state="new",
            tuning=tuning,
        )

    @property
    def socket_path(self) -> Path:
        return self.working_dir / SOCKET_NAME

    @property
    def advertised_peer_url(self) -> str:
        # Always advertise https, also during the plain-HTTP PKI bootstrap:
        # the member's URL is recorded in the cluster at creation and must
        # already be the one the TLS-enabled restart serves.
        return f"https://{self.peer_address}"

    def argv(self) -> list[str]:
        listen_scheme = "https" if self.peer_tls else "http"
        client_url = f"unix://{SOCKET_NAME}"
        args = [
            os.environ.get(ETCD_BINARY_ENV) or "etcd",
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={listen_scheme}://{self.peer_address}",
            f"--initial-advertise-peer-urls={self.advertised_peer_url}",
            "--initial-cluster="
            + ",".join(f"{name}={url}" for name, url in sorted(self.initial_cluster.items())),
            f"--initial-cluster-state={self.cluster_state}",
            f"--initial-cluster-token={self.cluster_token}",
            f"--heartbeat-interval={self.tuning.heartbeat_ms}",
            f"--election-timeout={self.tuning.election_ms}",
            f"--strict-reconfig-check={str(self.tuning.member_health_wait).lower()}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.peer_tls:
            args += [
                f"--peer-trusted-ca-file={self.peer_tls.ca_certificate}",
                f"--peer-cert-file={self.peer_tls.certificate}",
                f"--peer-key-file={self.peer_tls.key}",
                f"--peer-crl-file={self.peer_tls.crl}",
                "--peer-client-cert-auth",
            ]
        return args


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
    check_socket_path(config.socket_path)
    config.working_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    config.socket_path.unlink(missing_ok=True)
    logger.info("starting etcd: %s", " ".join(config.argv()))

    process = _Child.spawn(config.argv(), config.working_dir)
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


class _Child:
    """The etcd process: a Popen spawned from the Trio thread, awaited through a pidfd."""

    def __init__(self, popen: subprocess.Popen[bytes], output: trio.lowlevel.FdStream) -> None:
        self._popen = popen
        self.output = output
        self._pidfd = os.pidfd_open(popen.pid)

    @classmethod
    def spawn(cls, argv: list[str], cwd: Path) -> _Child:
        """Start ``argv`` in ``cwd``; it gets SIGKILL when this thread exits.

        Blocks the Trio thread for the fork (milliseconds); see the module
        docstring for why it must be this thread.
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
        return cls(popen, trio.lowlevel.FdStream(read_end))

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait until the process exits and reap it; return its exit status."""
        if self._popen.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
        returncode = self._popen.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return returncode

    def send_signal(self, sig: signal.Signals) -> None:
        # Until wait() reaped it, the pid cannot have been reused.
        if self._popen.returncode is None:
            self._popen.send_signal(sig)


async def _report_ready(
    socket: Path,
    process: _Child,
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


async def _stop(process: _Child, logger: logging.Logger) -> None:
    """Terminate and reap ``process``; shielded, so it also runs during cancellation."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            # SIGTERM lets a leader hand over leadership before going, which
            # spares the rest of the cluster an election timeout.
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(_STOP_GRACE):
                await process.wait()
            if process.returncode is None:
                logger.warning("etcd did not stop within %.0fs, killing it", _STOP_GRACE)
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
