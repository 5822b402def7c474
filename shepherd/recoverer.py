"""The recoverer: bring back machines whose agent went silent.

A control loop processor (see :mod:`shepherd.control_loop`) under the BMDB
process ``ShepherdRecovery``::

    source (in the claiming transaction)
      machines_for_agent_recovery(1, provider, timeouts)  ──none──▶ nothing to do
        agent started, but no heartbeat within first_heartbeat_timeout,
        or the last heartbeat older than heartbeat_timeout,
        or an operator asked for it (python -m bmdb recover-now)
    handle
      provider can reboot?  provider.reboot(provider_id)  ──ProviderError──▶ fail (backoff)
                            (ProviderUnsupported for this machine: as without REBOOT)
      finish: delete AgentStarted, AgentHeartbeat (and the operator's request)
                └─▶ the machine is an agent-start candidate again: the
                    initializer takes it over anew

Without ``Capability.REBOOT`` (the static provider) nothing is power-cycled:
the tags are cleared all the same, and the initializer's new takeover
replaces an agent that may still run (the agent stops its predecessor,
see ``shepherd/agent/daemon.py``). A machine that is down stays down; its
agent start then fails with the initializer's own backoff.

Recovery and agent start exclude each other on one machine (each source
skips machines with live work of either process).
"""

from __future__ import annotations

import logging
import uuid

from bmdb import Backoff, Process, Queries, Work
from bmdb.model import AGENT_FIRST_HEARTBEAT_TIMEOUT, AGENT_HEARTBEAT_TIMEOUT, AgentStarted
from shepherd.control_loop import ProcessingFailed
from shepherd.providers import Capability, Provider, ProviderError, ProviderUnsupported

logger = logging.getLogger("shepherd.recoverer")

#: The reference's backoff: 1 minute, growing by x1.2 up to 1 hour.
DEFAULT_BACKOFF = Backoff(initial=60, maximum=3600, exponent=1.2)


class Recoverer:
    """Recovers silent agents; a :class:`shepherd.control_loop.Processor`."""

    component = "shepherd-recoverer"
    process = Process.SHEPHERD_RECOVERY

    def __init__(
        self,
        provider: Provider,
        *,
        first_heartbeat_timeout: float = AGENT_FIRST_HEARTBEAT_TIMEOUT,
        heartbeat_timeout: float = AGENT_HEARTBEAT_TIMEOUT,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        if not first_heartbeat_timeout > 0 or not heartbeat_timeout > 0:
            raise ValueError("recovery timeouts must be positive")
        self.provider = provider
        self.first_heartbeat_timeout = first_heartbeat_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.backoff = backoff

    async def source(self, q: Queries) -> AgentStarted | None:
        machines = await q.machines_for_agent_recovery(
            1,
            provider=self.provider.type,
            first_heartbeat_timeout=self.first_heartbeat_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
        )
        return machines[0] if machines else None

    def machine_id(self, task: AgentStarted) -> uuid.UUID:
        return task.machine_id

    async def handle(self, work: Work, task: AgentStarted) -> None:
        mid = task.machine_id
        assert task.provided is not None  # the source joins on the provider
        provider_id = task.provided.provider_id
        logger.info("machine %s: agent silent, recovering (provider id %r)", mid, provider_id)
        if Capability.REBOOT in self.provider.capabilities:
            try:
                await self.provider.reboot(provider_id)
            except ProviderUnsupported as exc:
                # The provider reboots some machines, not this one (a static
                # machine listed without a BMC): treat it as a provider
                # without REBOOT, else it would fail here forever.
                logger.info("machine %s: %s; only restarting the agent", mid, exc)
            except ProviderError as exc:
                raise ProcessingFailed(f"failed to reboot machine: {exc}") from exc
            else:
                logger.info("machine %s: rebooted", mid)
        else:
            logger.info("machine %s: provider cannot reboot, only restarting the agent", mid)

        async def clear(q: Queries) -> None:
            await q.delete_agent_started(mid)
            await q.delete_agent_heartbeat(mid)
            await q.delete_recovery_request(mid)

        await work.finish(clear)
        logger.info("machine %s: AgentStarted and heartbeat cleared", mid)
