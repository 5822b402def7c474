"""The agent callback server: where running agents send their heartbeats.

::

    agent --HTTPS/1.1 POST /cloud.bmaas.server.api.AgentCallback/Heartbeat--> worker process
          (Connect unary: body = HeartbeatRequest, signed headers)   (N of them, SO_REUSEPORT)
      http1                       HTTP/1.1, keep-alive, size bounds, timeouts
      connect.ConnectUnary        path, method, content type; Connect errors
      authenticate                id, freshness, signature or session MAC
      service.HeartbeatService    queued for a group
      BMDB, one statement/group   key of the AgentStarted tag, newer time,
                                  heartbeat (+ hardware report); answers after commit
      hold                        an answer with nothing to carry waits for a request

Modules: `http1` (the HTTP/1.1 transport, its limits), `connect` (Connect's
unary protocol), `authenticate` (a request's checks that need no database),
`session` (the sessions that replace signatures by MACs), `service` (group
commit into the BMDB), `reports` (installation and upgrade reports, the
requests carried), `hold` (the long poll), `answers` (a response's bytes),
`server` (one process: listener, BMDB session, ``run_agent_server``),
`workers` (N such processes on one port), `images` (the node images the
agents install, by digest, on a listener of their own), ``__main__``
(``python -m shepherd.agent_server``).

Heartbeat answers also carry a machine's pending OS installation or upgrade
request, and heartbeats its agent's reports on them (see `reports`).
"""

from typing import TYPE_CHECKING

from common.lazy import exports

# Imported on first use (common.lazy).
if TYPE_CHECKING:
    from shepherd.agent_server.connect import ConnectError as ConnectError
    from shepherd.agent_server.connect import ConnectUnary as ConnectUnary
    from shepherd.agent_server.connect import Limits as Limits
    from shepherd.agent_server.server import AgentServerConfig as AgentServerConfig
    from shepherd.agent_server.server import run_agent_server as run_agent_server
    from shepherd.agent_server.service import HeartbeatService as HeartbeatService
else:
    __getattr__ = exports(
        __name__,
        {
            "shepherd.agent_server.connect": ["ConnectError", "ConnectUnary", "Limits"],
            "shepherd.agent_server.server": ["AgentServerConfig", "run_agent_server"],
            "shepherd.agent_server.service": ["HeartbeatService"],
        },
    )


__all__ = [
    "AgentServerConfig",
    "ConnectError",
    "ConnectUnary",
    "HeartbeatService",
    "Limits",
    "run_agent_server",
]
