"""Dataclass records returned by `Queries` (one per result shape)."""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass

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
