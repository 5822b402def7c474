"""The agent callback (``agent_callback.proto``, package ``cloud.bmaas.server.api``).

The method's path, like the rest of what agent and server agree on beyond
the messages, is in `shepherd.agent.protocol`.
"""

from shepherd.proto.gen.cloud.bmaas.server.api import (
    AgentHardwareReport,
    AgentSession,
    HeartbeatRequest,
    HeartbeatResponse,
    MetropolisInstallationRequest,
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
    UpgradeReport,
    UpgradeReportState,
    UpgradeRequest,
)

__all__ = [
    "AgentHardwareReport",
    "AgentSession",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "MetropolisInstallationRequest",
    "OsInstallationReport",
    "OsInstallationReportError",
    "OsInstallationReportSuccess",
    "OsInstallationRequest",
    "UpgradeReport",
    "UpgradeReportState",
    "UpgradeRequest",
]
