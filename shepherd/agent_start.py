"""Starting the agent on one machine over SSH: the initializer's per-machine step.

::

    start_agent(machine)
      |  no address?                    -> NoAddress
      |  within exec timeout:
      |    dial root@addr:port          -> DialFailed / HostKeyMismatch
      |    SFTP upload agent, 0755      -> UploadFailed
      |    run agent, TakeoverInit      -> RunFailed / AgentExited (status != 0)
      |      on stdin                   -> ExecTimeout (whole step too slow)
      |  parse TakeoverResponse         -> MalformedResponse / AgentError
      |  echoed init == sent init?      -> EchoMismatch
      |  len(key) == 32?                -> BadKeyLength
      v
    AgentStarted(key, host_key)

Every failure is a :class:`TakeoverFailed` whose message is the cause the
initializer records in the BMDB, so it must read well on its own.

This module knows nothing about the BMDB: it takes what it needs (machine id,
where to dial, the host key recorded so far) and returns or raises.
"""

from __future__ import annotations

import logging
import shlex
import uuid
from dataclasses import dataclass

import trio

from common.protobuf import parse_checked
from common.text import printable
from shepherd.errors import ShepherdError
from shepherd.proto.agent import TakeoverInit, TakeoverResponse
from shepherd.providers import Machine
from shepherd.ssh import (
    AuthenticationError,
    ChannelError,
    ConnectError,
    HostKeyChanged,
    SSHClient,
)

logger = logging.getLogger("shepherd.agent_start")

#: Length of an Ed25519 public key.
AGENT_KEY_LENGTH = 32

# How much of the agent's stderr goes into a failure cause.
_STDERR_EXCERPT = 300

#: Agent warnings kept from one reply; a flood beyond is summed up in one line.
MAX_WARNINGS = 16


@dataclass(frozen=True)
class AgentConfig:
    """How agents are deployed. Mirrors the seed's AgentConfig."""

    #: The agent program uploaded to every machine.
    executable: bytes
    #: Where the agent is uploaded to and run from on the machine.
    target_path: str
    #: The BMaaS endpoint address the agent is told to report to.
    endpoint: str
    #: DER X.509 CA certificate of the endpoint; empty to use system CAs.
    endpoint_ca_certificate: bytes
    #: Bound on TCP connect + SSH handshake, seconds.
    ssh_connect_timeout: float
    #: Bound on the whole step (dial, upload, run), seconds.
    ssh_exec_timeout: float
    #: Seconds between the agent's heartbeats, None for an agent that only
    #: answers the takeover and exits (then nothing ever heartbeats).
    heartbeat_interval: float | None = None
    #: Cap of the agent's backoff while its heartbeats fail, seconds.
    heartbeat_backoff_cap: float = 60.0
    #: Bounds of the agent's image downloads, seconds (None: the agent's
    #: defaults, `shepherd.agent.install.Settings`): the whole download,
    #: retries included, and the first and longest pause between attempts.
    install_download_deadline: float | None = None
    install_backoff_start: float | None = None
    install_backoff_cap: float | None = None
    #: A real disk's partition sizes in MiB (boot, each system slot, the
    #: data partition's least), None for the agent's (Monogon's sizes).
    install_layout: tuple[int, int, int] | None = None
    #: After a real install: "start" the node's unit (the agent's default),
    #: "reboot" the machine, or "none".
    install_after: str | None = None
    #: Run the heartbeating agent as a unit of the machine's systemd, so
    #: that it comes back after a reboot (`shepherd.agent.unit`), instead of
    #: a daemon detached from the SSH session. For machines whose init is
    #: systemd; on others the agent falls back to the daemon (and warns).
    systemd_unit: bool = False

    def __post_init__(self) -> None:
        # The seed's New() checks, so a misconfigured initializer fails at start.
        if not self.executable:
            raise ValueError("agent executable not configured (empty)")
        if not self.target_path:
            raise ValueError("agent target path must be set")
        if not self.target_path.startswith("/"):
            # Relative to whatever directory the remote shell starts in: the
            # agent and its key would land somewhere nobody chose.
            raise ValueError(f"agent target path must be absolute, got {self.target_path!r}")
        if not self.endpoint:
            raise ValueError("agent endpoint must be set")
        if self.ssh_connect_timeout <= 0:
            raise ValueError("agent SSH connect timeout must be positive")
        if self.ssh_exec_timeout <= 0:
            raise ValueError("agent SSH exec timeout must be positive")
        if self.heartbeat_interval is not None and not self.heartbeat_interval > 0:
            raise ValueError("agent heartbeat interval must be positive")
        if not self.heartbeat_backoff_cap > 0:
            raise ValueError("agent heartbeat backoff cap must be positive")
        for flag, value in self._install_flags():
            if not 0 < value < float("inf"):
                raise ValueError(f"agent {flag} must be positive, got {value!r}")
        if self.install_layout is not None and (
            len(self.install_layout) != 3 or min(self.install_layout) < 1
        ):
            raise ValueError(
                f"agent install layout must be 3 positive MiB sizes, got {self.install_layout!r}"
            )
        if self.install_after not in (None, "start", "reboot", "none"):
            raise ValueError(
                f"agent install_after must be start, reboot or none, got {self.install_after!r}"
            )

    def _install_flags(self) -> list[tuple[str, float]]:
        flags = [
            ("--install-download-deadline", self.install_download_deadline),
            ("--install-backoff-start", self.install_backoff_start),
            ("--install-backoff-cap", self.install_backoff_cap),
        ]
        return [(flag, value) for flag, value in flags if value is not None]

    def command(self) -> str:
        """The shell command that runs the uploaded agent."""
        command = shlex.quote(self.target_path)
        if self.heartbeat_interval is not None:
            command += (
                f" --heartbeat-interval {self.heartbeat_interval:g}"
                f" --heartbeat-backoff-cap {self.heartbeat_backoff_cap:g}"
            )
            command += "".join(f" {flag} {value!r}" for flag, value in self._install_flags())
            if self.install_layout is not None:
                command += " --install-layout " + ",".join(map(str, self.install_layout))
            if self.install_after is not None:
                command += f" --install-after {self.install_after}"
            if self.systemd_unit:
                command += " --systemd-unit"
        return command


@dataclass(frozen=True)
class AgentStarted:
    """A successful takeover."""

    #: The agent's Ed25519 public key.
    key: bytes
    #: The host key the machine's SSH server presented (to record on first use).
    host_key: bytes
    #: Warnings the agent reported alongside success.
    warnings: list[str]


class TakeoverFailed(ShepherdError):
    """Starting the agent failed; ``str(exc)`` is the cause to record.

    ``host_key`` is the machine's SSH host key if the connection got that far
    (so that trust on first use can record it even when the agent failed).
    """

    def __init__(self, cause: str, host_key: bytes | None = None) -> None:
        super().__init__(cause)
        self.host_key = host_key


class NoAddress(TakeoverFailed):
    """The provider knows no address for the machine."""


class DialFailed(TakeoverFailed):
    """The SSH connection could not be set up (unreachable, refused, timeout, auth)."""


class HostKeyMismatch(TakeoverFailed):
    """The machine's SSH host key is not the one recorded on first use."""


class UploadFailed(TakeoverFailed):
    """The agent could not be uploaded."""


class RunFailed(TakeoverFailed):
    """The SSH session broke while the agent ran."""


class ExecTimeout(TakeoverFailed):
    """Dial, upload and run did not finish within the exec timeout."""


class AgentExited(TakeoverFailed):
    """The agent (or the remote shell) exited non-zero or was killed."""


class MalformedResponse(TakeoverFailed):
    """The agent's stdout is not a TakeoverResponse, or has neither result."""


class AgentError(TakeoverFailed):
    """The agent answered with a TakeoverError."""


class EchoMismatch(TakeoverFailed):
    """The agent did not echo the init message it was sent."""


class BadKeyLength(TakeoverFailed):
    """The agent's key is not 32 bytes long."""


def init_message(machine_id: uuid.UUID, config: AgentConfig) -> TakeoverInit:
    """The TakeoverInit sent to the agent on ``machine_id``."""
    return TakeoverInit(
        machine_id=str(machine_id),
        bmaas_endpoint=config.endpoint,
        ca_certificate=config.endpoint_ca_certificate,
    )


async def start_agent(
    client: SSHClient,
    machine: Machine,
    machine_id: uuid.UUID,
    config: AgentConfig,
    *,
    known_host_key: bytes | None,
) -> AgentStarted:
    """Upload and run the agent on ``machine``; return its key.

    ``known_host_key`` is the host key recorded for this machine, or None to
    trust the one presented (first use). Raises a :class:`TakeoverFailed`
    subclass for every failure on the machine's side; cancellation from the
    caller propagates (after the SSH connection is closed).
    """
    if not machine.address:
        raise NoAddress(f"machine has no address (provider id {machine.id!r})")
    where = f"{machine.address}:{machine.port}"
    init = init_message(machine_id, config)
    host_key: bytes | None = None
    result = None
    with trio.move_on_after(config.ssh_exec_timeout) as deadline:
        try:
            async with client.connect(
                machine.address, machine.port, known_host_key=known_host_key
            ) as conn:
                host_key = conn.host_key
                logger.info("machine %s: uploading agent to %s", machine_id, where)
                try:
                    await conn.upload(config.target_path, config.executable)
                except ChannelError as exc:
                    raise UploadFailed(f"agent upload failed: {exc}", host_key) from exc
                logger.debug("machine %s: running %s", machine_id, config.target_path)
                try:
                    result = await conn.run(config.command(), stdin=bytes(init))
                except ChannelError as exc:
                    raise RunFailed(f"running the agent failed: {exc}", host_key) from exc
        except HostKeyChanged as exc:
            raise HostKeyMismatch(f"SSH host key changed: {exc}") from exc
        except (ConnectError, AuthenticationError) as exc:
            # exc.host_key is set if the handshake completed: record it.
            raise DialFailed(f"SSH dial failed: {exc}", exc.host_key) from exc
    if result is None:
        assert deadline.cancelled_caught
        stage = "connecting" if host_key is None else "uploading or running the agent"
        raise ExecTimeout(
            f"timed out after {config.ssh_exec_timeout:g}s while {stage} on {where}",
            host_key,
        )
    assert host_key is not None
    stderr = result.stderr.decode("utf-8", errors="replace").strip()
    if stderr:
        logger.warning("machine %s: agent stderr: %r", machine_id, stderr[:_STDERR_EXCERPT])
    if result.exit_status != 0:
        how = (
            f"was killed by signal {result.exit_signal}"
            if result.exit_signal
            else f"exited with status {result.exit_status}"
        )
        raise AgentExited(f"agent {how}: stderr {stderr[:_STDERR_EXCERPT]!r}", host_key)
    key, warnings = parse_response(result.stdout, init, host_key)
    for warning in warnings:
        logger.warning("machine %s: agent warning: %s", machine_id, printable(warning))
    return AgentStarted(key, host_key, warnings)


@dataclass(frozen=True)
class _Reply:
    """A decoded TakeoverResponse: at most one of error / success."""

    error: str | None = None
    init: TakeoverInit | None = None
    key: bytes = b""
    warnings: tuple[str, ...] = ()


def _decode_reply(data: bytes) -> _Reply:
    """Decode a TakeoverResponse strictly; raise ``ValueError`` on anything odd.

    Strictly (`common.protobuf`) because betterproto2 alone is lenient
    where a hostile machine must not be: it turns truncated bytes into an
    empty message, accepts a field of the wrong wire type, and resolves a
    reply with both oneof members set by taking the last. Unknown fields are
    skipped, as the protobuf rules say (a newer agent may add some).
    """
    response = parse_checked(TakeoverResponse, data)
    if response.error is not None:
        return _Reply(error=response.error.message)
    success = response.success
    if success is None:
        return _Reply()
    return _Reply(
        init=success.init_message or TakeoverInit(),
        key=success.key,
        warnings=tuple(success.warning),
    )


def parse_response(
    stdout: bytes, sent: TakeoverInit, host_key: bytes | None = None
) -> tuple[bytes, list[str]]:
    """Check the agent's answer to ``sent``; return (key, warnings).

    Raises :class:`MalformedResponse` (not a well-formed TakeoverResponse,
    or neither/both results set), :class:`AgentError`,
    :class:`EchoMismatch` or :class:`BadKeyLength`; never anything else,
    whatever the bytes.
    """
    if not stdout:
        raise MalformedResponse("agent wrote nothing to stdout", host_key)
    try:
        reply = _decode_reply(stdout)
    except ValueError as exc:
        excerpt = stdout[:64]
        raise MalformedResponse(
            f"agent reply is not a TakeoverResponse ({exc}); first bytes {excerpt!r}", host_key
        ) from exc
    if reply.error is not None:
        raise AgentError(f"agent returned error: {printable(reply.error)}", host_key)
    if reply.init is None:
        raise MalformedResponse("agent reply has neither success nor error", host_key)
    if reply.init != sent:
        raise EchoMismatch(
            f"agent did not echo the init message: sent {sent!r}, got {reply.init!r}",
            host_key,
        )
    warnings = list(reply.warnings[:MAX_WARNINGS])
    if len(reply.warnings) > MAX_WARNINGS:
        warnings.append(f"({len(reply.warnings) - MAX_WARNINGS} more warnings not shown)")
    if len(reply.key) != AGENT_KEY_LENGTH:
        raise BadKeyLength(
            f"agent key is {len(reply.key)} bytes, want {AGENT_KEY_LENGTH}", host_key
        )
    return reply.key, warnings
