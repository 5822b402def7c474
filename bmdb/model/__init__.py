"""The BMDB's data model: SQL enum mirrors, row records and `Queries`."""

from typing import TYPE_CHECKING

from common.lazy import exports

# Imported on first use (common.lazy): the enums and rows need no driver.
if TYPE_CHECKING:
    from bmdb.model.agents import AgentHeartbeat as AgentHeartbeat
    from bmdb.model.agents import HeartbeatOutcome as HeartbeatOutcome
    from bmdb.model.checks import MAX_INSTALLATION_TEXT as MAX_INSTALLATION_TEXT
    from bmdb.model.checks import as_uuid as as_uuid
    from bmdb.model.enums import Process as Process
    from bmdb.model.enums import Provider as Provider
    from bmdb.model.enums import ProviderStatus as ProviderStatus
    from bmdb.model.enums import WorkEvent as WorkEvent
    from bmdb.model.queries import Queries as Queries
    from bmdb.model.rows import AgentStarted as AgentStarted
    from bmdb.model.rows import AuditRecord as AuditRecord
    from bmdb.model.rows import DecommissionTarget as DecommissionTarget
    from bmdb.model.rows import HistoryEvent as HistoryEvent
    from bmdb.model.rows import Hold as Hold
    from bmdb.model.rows import InstallationTarget as InstallationTarget
    from bmdb.model.rows import InstallState as InstallState
    from bmdb.model.rows import MachineProvided as MachineProvided
    from bmdb.model.rows import MachineSummary as MachineSummary
    from bmdb.model.rows import MachineUpgrade as MachineUpgrade
    from bmdb.model.rows import OSInstallation as OSInstallation
    from bmdb.model.rows import SessionInfo as SessionInfo
    from bmdb.model.rows import UpgradePlanEntry as UpgradePlanEntry
    from bmdb.model.rows import UpgradeRun as UpgradeRun
    from bmdb.model.rows import UpgradeState as UpgradeState
    from bmdb.model.rows import UpgradeTarget as UpgradeTarget
    from bmdb.model.rows import WorkInfo as WorkInfo
    from bmdb.model.rows import node_id as node_id
    from bmdb.model.sourcing import AGENT_FIRST_HEARTBEAT_TIMEOUT as AGENT_FIRST_HEARTBEAT_TIMEOUT
    from bmdb.model.sourcing import AGENT_HEARTBEAT_TIMEOUT as AGENT_HEARTBEAT_TIMEOUT
    from bmdb.model.sourcing import SOURCING_WINDOW as SOURCING_WINDOW
else:
    __getattr__ = exports(
        __name__,
        {
            "bmdb.model.enums": ["Process", "Provider", "ProviderStatus", "WorkEvent"],
            "bmdb.model.agents": ["AgentHeartbeat", "HeartbeatOutcome"],
            "bmdb.model.checks": ["MAX_INSTALLATION_TEXT", "as_uuid"],
            "bmdb.model.queries": ["Queries"],
            "bmdb.model.sourcing": [
                "AGENT_FIRST_HEARTBEAT_TIMEOUT",
                "AGENT_HEARTBEAT_TIMEOUT",
                "SOURCING_WINDOW",
            ],
            "bmdb.model.rows": [
                "AgentStarted",
                "AuditRecord",
                "DecommissionTarget",
                "HistoryEvent",
                "Hold",
                "InstallationTarget",
                "InstallState",
                "MachineProvided",
                "MachineSummary",
                "MachineUpgrade",
                "OSInstallation",
                "SessionInfo",
                "UpgradePlanEntry",
                "UpgradeRun",
                "UpgradeState",
                "UpgradeTarget",
                "WorkInfo",
                "node_id",
            ],
        },
    )

__all__ = [
    "AGENT_FIRST_HEARTBEAT_TIMEOUT",
    "AGENT_HEARTBEAT_TIMEOUT",
    "MAX_INSTALLATION_TEXT",
    "SOURCING_WINDOW",
    "AgentHeartbeat",
    "AgentStarted",
    "AuditRecord",
    "DecommissionTarget",
    "HeartbeatOutcome",
    "HistoryEvent",
    "Hold",
    "InstallState",
    "InstallationTarget",
    "MachineProvided",
    "MachineSummary",
    "MachineUpgrade",
    "OSInstallation",
    "Process",
    "Provider",
    "ProviderStatus",
    "Queries",
    "SessionInfo",
    "UpgradePlanEntry",
    "UpgradeRun",
    "UpgradeState",
    "UpgradeTarget",
    "WorkEvent",
    "WorkInfo",
    "as_uuid",
    "node_id",
]
