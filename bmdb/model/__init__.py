"""The BMDB's data model: SQL enum mirrors, row records and `Queries`."""

from bmdb.model.enums import Process, Provider, ProviderStatus, WorkEvent
from bmdb.model.queries import (
    AGENT_FIRST_HEARTBEAT_TIMEOUT,
    AGENT_HEARTBEAT_TIMEOUT,
    MAX_INSTALLATION_TEXT,
    SOURCING_WINDOW,
    AgentHeartbeat,
    HeartbeatOutcome,
    Queries,
    as_uuid,
)
from bmdb.model.rows import (
    AgentStarted,
    AuditRecord,
    HistoryEvent,
    Hold,
    InstallationTarget,
    InstallState,
    MachineProvided,
    MachineSummary,
    OSInstallation,
    SessionInfo,
    WorkInfo,
    node_id,
)

__all__ = [
    "AGENT_FIRST_HEARTBEAT_TIMEOUT",
    "AGENT_HEARTBEAT_TIMEOUT",
    "MAX_INSTALLATION_TEXT",
    "SOURCING_WINDOW",
    "AgentHeartbeat",
    "AgentStarted",
    "AuditRecord",
    "HeartbeatOutcome",
    "HistoryEvent",
    "Hold",
    "InstallState",
    "InstallationTarget",
    "MachineProvided",
    "MachineSummary",
    "OSInstallation",
    "Process",
    "Provider",
    "ProviderStatus",
    "Queries",
    "SessionInfo",
    "WorkEvent",
    "WorkInfo",
    "as_uuid",
    "node_id",
]
