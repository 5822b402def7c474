"""The BMDB's data model: SQL enum mirrors, row records and `Queries`."""

from bmdb.model.enums import Process, Provider, ProviderStatus, WorkEvent
from bmdb.model.queries import SOURCING_WINDOW, Queries, as_uuid
from bmdb.model.rows import (
    AgentStarted,
    HistoryEvent,
    MachineProvided,
    MachineSummary,
    SessionInfo,
    WorkInfo,
)

__all__ = [
    "SOURCING_WINDOW",
    "AgentStarted",
    "HistoryEvent",
    "MachineProvided",
    "MachineSummary",
    "Process",
    "Provider",
    "ProviderStatus",
    "Queries",
    "SessionInfo",
    "WorkEvent",
    "WorkInfo",
    "as_uuid",
]
