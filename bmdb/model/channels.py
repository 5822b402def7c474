"""The notifications the BMDB sends (PostgreSQL ``NOTIFY``), by channel.

A statement that writes what a waiter waits for sends a notification on
the channel of that kind of write, its payload the machine's id (text), in
the same transaction: PostgreSQL delivers it to every session that
``LISTEN``s on the channel when, and only if, the transaction commits
(`bmdb.notify` listens). A notification says only "look again": a
listener that missed some (its connection lost, a failover) reads the
tables again once it listens anew, so none is needed for correctness,
only for latency. Notifications are not replicated: a listener on a
standby hears nothing, and ``LISTEN`` is refused there.
"""

from __future__ import annotations

__all__ = ["AGENT_REQUEST", "CHANNELS", "INSTALL_REPORT"]

#: A request for a machine's agent was written (an OS installation request:
#: `Queries.set_os_installation_request`; an upgrade's write or activation:
#: `Queries.write_upgrade`, `Queries.request_upgrade`); the agent callback
#: server answers that agent's held heartbeat with it.
AGENT_REQUEST = "bmdb_agent_request"
#: An agent's report on an OS installation was stored
#: (`Queries.record_os_installation_report`); the approver looks for the
#: node it names.
INSTALL_REPORT = "bmdb_install_report"

#: Every channel: names of lower-case letters and underscores, so that they
#: need no quoting in ``LISTEN``.
CHANNELS = (AGENT_REQUEST, INSTALL_REPORT)
