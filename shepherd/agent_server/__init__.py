"""The agent callback server: where running agents send their heartbeats.

::

    agent --HTTPS/1.1 POST /cloud.bmaas.server.api.AgentCallback/Heartbeat--> hypercorn (trio)
          (Connect unary: body = HeartbeatRequest, signed headers)
      connect.ConnectApp          size, deadline, framing
      service.HeartbeatService    id, freshness, signature
      BMDB, one statement         key of the AgentStarted tag, newer time,
                                  heartbeat (+ hardware report)

Modules: `connect` (Connect's unary protocol as an ASGI app, with the
limits), `service` (authentication and the BMDB write), `server` (hypercorn,
the BMDB session, ``run_agent_server``), ``__main__`` (``python -m
shepherd.agent_server``).
"""

from shepherd.agent_server.connect import ConnectApp, ConnectError, Limits
from shepherd.agent_server.server import AgentServerConfig, run_agent_server
from shepherd.agent_server.service import HeartbeatService

__all__ = [
    "AgentServerConfig",
    "ConnectApp",
    "ConnectError",
    "HeartbeatService",
    "Limits",
    "run_agent_server",
]
