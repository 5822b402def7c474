"""The initializer: start the agent on every provided machine that lacks one.

It is a control loop processor (see :mod:`shepherd.control_loop`) under the
BMDB process ``ShepherdAgentStart``::

    source (in the claiming transaction)
      machines_for_agent_start(1)  ──none──▶ nothing to do
      get_ssh_host_key(machine)          (None: never connected yet)
    handle
      provider.get_machine(provider_id)  ──ProviderError──▶ fail
      takeover.start_agent(...)          ──TakeoverFailed──▶ fail with its cause
      finish: set_agent_started(now, key) [+ set_ssh_host_key on first use]

SSH host keys are trusted on first use: the key of a machine whose SSH
handshake completed (the server proved it holds the key) is recorded, when
the takeover succeeds or, if it fails after the handshake (our key refused,
upload or agent failed), in a transaction of its own before the failure, so
that a later impostor is refused even if the first attempt failed. A recorded
key is never replaced here, not even by the success path of a worker that
sourced the machine before the key was recorded; an operator who re-installed
a machine forgets it (``python -m bmdb forget-host-key MACHINE --reason ...``),
and the next takeover pins the key it then sees.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from dataclasses import dataclass

from bmdb import Backoff, Process, Queries, Work
from bmdb.model import MachineProvided
from shepherd.agent_start import AgentConfig, TakeoverFailed, start_agent
from shepherd.control_loop import ProcessingFailed
from shepherd.providers import Provider, ProviderError
from shepherd.ssh import SSHClient

logger = logging.getLogger("shepherd.initializer")

#: The seed's production backoff: 5 minutes, growing by x1.2 up to 4 hours.
DEFAULT_BACKOFF = Backoff(initial=5 * 60, maximum=4 * 3600, exponent=1.2)


@dataclass(frozen=True)
class InitializerTask:
    """A machine sourced for agent start."""

    machine: MachineProvided
    #: The host key recorded for the machine, None if never connected.
    known_host_key: bytes | None


class Initializer:
    """Starts agents; a :class:`shepherd.control_loop.Processor`."""

    component = "shepherd-initializer"
    process = Process.SHEPHERD_AGENT_START

    def __init__(
        self,
        provider: Provider,
        ssh: SSHClient,
        agent: AgentConfig,
        *,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.provider = provider
        self.ssh = ssh
        self.agent = agent
        self.backoff = backoff

    async def source(self, q: Queries) -> InitializerTask | None:
        machines = await q.machines_for_agent_start(1)
        if not machines:
            return None
        machine = machines[0]
        return InitializerTask(machine, await q.get_ssh_host_key(machine.machine_id))

    def machine_id(self, task: InitializerTask) -> uuid.UUID:
        return task.machine.machine_id

    async def handle(self, work: Work, task: InitializerTask) -> None:
        machine = task.machine
        mid = machine.machine_id
        if machine.provider != self.provider.type:
            raise ProcessingFailed(
                f"machine is provided by {machine.provider}, "
                f"this initializer serves {self.provider.type}"
            )
        logger.info("machine %s: needs agent start, provider id %r", mid, machine.provider_id)
        try:
            target = await self.provider.get_machine(machine.provider_id)
        except ProviderError as exc:
            raise ProcessingFailed(f"failed to fetch machine from provider: {exc}") from exc
        try:
            started = await start_agent(
                self.ssh, target, mid, self.agent, known_host_key=task.known_host_key
            )
        except TakeoverFailed as exc:
            if task.known_host_key is None and exc.host_key is not None:
                await self._record_host_key(work, exc.host_key)
            raise ProcessingFailed(str(exc)) from exc

        first_use = task.known_host_key is None
        now = datetime.datetime.now(datetime.UTC)

        async def apply(q: Queries) -> None:
            await q.set_agent_started(mid, now, started.key)
            if first_use:
                await _record_if_none(q, mid, started.host_key)

        await work.finish(apply)
        logger.info("machine %s: agent started, key %s", mid, started.key.hex())

    async def _record_host_key(self, work: Work, host_key: bytes) -> None:
        mid = work.machine_id

        async def record(q: Queries) -> None:
            await _record_if_none(q, mid, host_key)

        await work.transact(record)


async def _record_if_none(q: Queries, mid: uuid.UUID, host_key: bytes) -> None:
    """Record ``host_key`` unless the machine already has one: never replace it.

    Another worker cannot hold this machine (we hold its work), but another
    process (a recoverer, an operator) may have recorded a key since we
    sourced the machine: that record stands.
    """
    recorded = await q.get_ssh_host_key(mid)
    if recorded is None:
        await q.set_ssh_host_key(mid, host_key)
        logger.info("machine %s: recorded SSH host key on first use", mid)
    elif recorded != host_key:
        logger.warning(
            "machine %s: an SSH host key was recorded meanwhile and differs from the one "
            "seen; keeping the recorded one",
            mid,
        )
