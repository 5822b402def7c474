"""The agent callback (``agent_callback.proto``, package ``cloud.bmaas.server.api``)."""

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
)

#: The Connect (and gRPC) path of the one method.
HEARTBEAT_PATH = "/cloud.bmaas.server.api.AgentCallback/Heartbeat"

__all__ = [
    "HEARTBEAT_PATH",
    "AgentHardwareReport",
    "AgentSession",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "MetropolisInstallationRequest",
    "OsInstallationReport",
    "OsInstallationReportError",
    "OsInstallationReportSuccess",
    "OsInstallationRequest",
]
