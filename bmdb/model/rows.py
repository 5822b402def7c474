"""Dataclass records returned by `Queries` (one per result shape)."""

from __future__ import annotations

import datetime
import enum
import uuid
from dataclasses import dataclass

from bmdb.errors import InvalidArgument
from bmdb.model.enums import Process, Provider, ProviderStatus, WorkEvent


@dataclass(frozen=True, slots=True)
class MachineProvided:
    """The `machine_provided` tag: which provider supplies the machine."""

    machine_id: uuid.UUID
    provider: Provider
    provider_id: str
    address: str | None
    location: str | None
    status: ProviderStatus


@dataclass(frozen=True, slots=True)
class AgentStarted:
    """The `machine_agent_started` tag, joined with the provider tag."""

    machine_id: uuid.UUID
    started_at: datetime.datetime
    public_key: bytes
    provided: MachineProvided | None


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One entry of a machine's work history."""

    machine_id: uuid.UUID
    process: Process
    event: WorkEvent
    at: datetime.datetime
    session_id: uuid.UUID | None
    cause: str | None


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A row of the sessions table."""

    session_id: uuid.UUID
    component: str
    runtime_info: str
    created_at: datetime.datetime
    interval: float
    deadline: datetime.datetime
    expired: bool


@dataclass(frozen=True, slots=True)
class WorkInfo:
    """A live or stale work row."""

    machine_id: uuid.UUID
    process: Process
    session_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class MachineSummary:
    """A machine and the tags it carries (for listings such as the CLI)."""

    machine_id: uuid.UUID
    created_at: datetime.datetime
    provided: MachineProvided | None
    agent_started_at: datetime.datetime | None
    agent_heartbeat_at: datetime.datetime | None
    has_hardware_report: bool
    work: tuple[Process, ...]


class InstallState(enum.StrEnum):
    """Where a machine's OS installation is, from its request and report."""

    #: Generation g requested, no report on g yet.
    INSTALLING = "installing"
    #: The agent reported success on the requested generation.
    INSTALLED = "installed"
    #: The agent reported an error on the requested generation.
    INSTALL_FAILED = "install-failed"
    #: Installed, but the agent has since found it gone from the disk.
    INSTALL_LOST = "install-lost"


class State(enum.StrEnum):
    """An operator-facing machine state (what each means: `bmdb.overview`, which
    computes it in SQL)."""

    DECOMMISSIONED = "decommissioned"
    FAILED = "failed"
    UNPROVIDED = "unprovided"
    NEEDS_AGENT_START = "needs-agent-start"
    STARTED = "started"
    HEARTBEATING = "heartbeating"
    SILENT = "silent"

    @classmethod
    def parse(cls, value: str) -> State:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise InvalidArgument(f"unknown state {value!r} (known: {known})") from None


def parse_state_filter(value: str) -> State | InstallState:
    """A ``state`` filter: a `State` or an `InstallState` by name;
    `InvalidArgument` naming both kinds otherwise."""
    for kind in (State, InstallState):
        try:
            return kind(value)
        except ValueError:
            pass
    known = ", ".join([*State, *InstallState])
    raise InvalidArgument(f"unknown state {value!r} (known: {known})")


#: Every name a ``state`` filter takes (for command-line choices).
STATE_FILTERS = (*(str(s) for s in State), *(str(s) for s in InstallState))


#: The prefix of a Metropolis node id (metropolis.identity.NODE_ID_PREFIX;
#: the BMDB imports nothing of the node half).
NODE_ID_PREFIX = "metropolis-"


def node_id(public_key: bytes) -> str:
    """The Metropolis node id of a raw Ed25519 public key: ``metropolis-``
    and the hex of its first 16 bytes (as metropolis.identity.node_id)."""
    return NODE_ID_PREFIX + public_key[:16].hex()


@dataclass(frozen=True, slots=True)
class OSInstallation:
    """A machine's OS installation request and the report on it, as far as
    the views need them (the raw protobuf bytes stay in the database)."""

    #: The requested generation.
    generation: int
    #: None in rows written before migration 0003 (raw bytes only).
    root_device: str | None
    image_digest: str | None
    node_address: str | None
    requested_at: datetime.datetime
    #: The generation of the stored report, if any (it may be older).
    report_generation: int | None
    #: The report's outcome; None without a report (or without its outcome).
    success: bool | None
    cause: str | None
    node_public_key: bytes | None
    reported_at: datetime.datetime | None
    #: Why the agent finds the installed generation gone (None: there, or
    #: not checked); when it last reported on it after the install.
    lost_cause: str | None = None
    checked_at: datetime.datetime | None = None

    @property
    def state(self) -> InstallState:
        """Installed or failed once the report is on the requested
        generation, installing until then; lost when installed and the
        agent has found it gone since."""
        if self.report_generation != self.generation or self.success is None:
            return InstallState.INSTALLING
        if self.success:
            return InstallState.INSTALLED if self.lost_cause is None else InstallState.INSTALL_LOST
        return InstallState.INSTALL_FAILED

    @property
    def reported(self) -> bool:
        """Whether the stored report is on the requested generation."""
        return self.state is not InstallState.INSTALLING

    @property
    def node_id(self) -> str | None:
        """The installed node's id, once installed with a key reported."""
        if self.state is InstallState.INSTALLED and self.node_public_key is not None:
            return node_id(self.node_public_key)
        return None


@dataclass(frozen=True, slots=True)
class InstallationTarget:
    """A machine as ``shepherd install`` weighs it (`Queries.installation_target`)."""

    machine_id: uuid.UUID
    #: The provider's address of the machine (machine_provided), if any.
    address: str | None
    #: The stored serialized AgentHardwareReport, if any.
    hardware_report: bytes | None
    installation: OSInstallation | None
    #: Who holds the machine and why (``bmdb hold``), if anyone does.
    held: str | None = None
    #: An operator asked to decommission it (or it was).
    decommissioned: bool = False


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One operator action, as the audit log keeps it (see `bmdb.actions`)."""

    id: int
    at: datetime.datetime
    #: Who: the operator's name (the OS user, or what ``--operator`` said).
    operator: str
    #: What: the action's name, e.g. ``hold`` (`bmdb.actions.Action`).
    action: str
    #: The machine acted on; it may no longer exist (``forget-machine``).
    machine_id: uuid.UUID | None
    #: Why, in the operator's words.
    reason: str
    #: What changed, in one line.
    detail: str


@dataclass(frozen=True, slots=True)
class DecommissionTarget:
    """A machine sourced for decommissioning, and how far it got."""

    machine_id: uuid.UUID
    provided: MachineProvided | None
    #: The pinned SSH host key (a wipe dials only a machine that proves it).
    host_key: bytes | None
    #: The agent's wipe report is stored (a retry does not wipe again).
    wiped: bool
    #: The provider released it (a retry does not release again).
    released: bool
    #: The node key of the machine's current successful installation
    #: report: the machine is (or was) that cluster node.
    node_public_key: bytes | None = None
    #: That node's removal from the cluster is recorded (not done again).
    node_removed: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """An operator's hold on a machine: no process is offered it meanwhile."""

    held_by: str
    held_at: datetime.datetime
    reason: str


class UpgradeState(enum.StrEnum):
    """Where a machine is in an upgrade run (``machine_upgrade.state``)."""

    #: Waits for its turn.
    PENDING = "pending"
    #: Its request is carried to its agent: being upgraded (unavailable).
    REQUESTED = "requested"
    #: Its node runs the new image, healthy, the slot permanent.
    UPGRADED = "upgraded"
    #: The machine went back to the image it ran; the run stopped there.
    ROLLED_BACK = "rolled-back"
    #: Nothing changed on it (refused, the image not written); the run stopped.
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (UpgradeState.UPGRADED, UpgradeState.ROLLED_BACK, UpgradeState.FAILED)


@dataclass(frozen=True, slots=True)
class UpgradeRun:
    """A rolling upgrade of a set of machines to one image (``upgrade_run``)."""

    run_id: uuid.UUID
    image_digest: str
    #: The serialized OSImageRef the agents download.
    os_image: bytes
    max_unavailable: int
    health_timeout: int
    requested_by: str
    requested_at: datetime.datetime
    #: When every machine was upgraded, or the run stopped (then `stop_cause`).
    finished_at: datetime.datetime | None
    stop_cause: str | None

    @property
    def running(self) -> bool:
        return self.finished_at is None


@dataclass(frozen=True, slots=True)
class MachineUpgrade:
    """One machine of an upgrade run (``machine_upgrade``)."""

    run_id: uuid.UUID
    machine_id: uuid.UUID
    state: UpgradeState
    #: 0 not a consensus member, 1 a consensus member, 2 the leader's node.
    phase: int
    position: int
    root_device: str
    #: The image its node ran when the run was made.
    from_digest: str | None
    generation: int | None
    requested_at: datetime.datetime | None
    #: What its node ran when its upgrade ended: slot and ``sha256:`` digest.
    slot: str | None
    running_digest: str | None
    #: Why it waits, or why it failed or went back (one line).
    detail: str | None
    #: The agent's latest report on `generation` (staged, committed, ...).
    agent_state: str | None
    agent_detail: str | None
    agent_slot: str | None
    agent_reported_at: datetime.datetime | None
    updated_at: datetime.datetime


@dataclass(frozen=True, slots=True)
class UpgradeTarget:
    """A machine sourced for its upgrade: the run, its row, and the node its
    current successful installation report names."""

    run: UpgradeRun
    machine: MachineUpgrade
    node_public_key: bytes | None


@dataclass(frozen=True, slots=True)
class UpgradePlanEntry:
    """A machine as a new run lists it."""

    machine_id: uuid.UUID
    phase: int
    position: int
    root_device: str
    from_digest: str | None
