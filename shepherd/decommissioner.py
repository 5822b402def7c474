"""The decommissioner: wipe machines an operator asked to decommission,
release them to their provider, and leave a tombstone.

A control loop processor (see :mod:`shepherd.control_loop`) under the BMDB
process ``ShepherdDecommission``; an operator asks with ``python -m bmdb
decommission MACHINE --reason ...`` (audited), and from then on no other
process is offered the machine::

    source (in the claiming transaction)
      machines_for_decommission(1)        requested, not done, not held
    handle
      not wiped yet:
        no pinned SSH host key            ──▶ fail: a wipe dials only a machine
                                              that proved its key at a takeover
        provider.get_machine(id)          ──ProviderError──▶ fail (backoff)
        ssh <address> '<agent> --wipe'    ──SSH error, agent error──▶ fail
          the agent stops itself and the installed nodes, empties the
          loopback disks, removes its key, prints what it did (JSON)
        record_wipe(report)               one transaction of its own
      not released yet:
        provider.release(id)              ──ProviderError──▶ fail (backoff)
          Equinix: the device is deleted; static: marked removed
        record_release(detail)            one transaction of its own
      finish: tombstone                   decommissioned_at; agent tags cleared

Each step is recorded before the next starts, so a retry (after a failure,
a crash, a lost session) resumes where it stopped: a machine is never
released before its wipe is reported (the BMDB's CHECKs hold that too), and
a wipe already reported is not run again. A cluster node is not removed from
its cluster first: the cluster has no node deletion yet (issue 27, item 3).
"""

from __future__ import annotations

import json
import logging
import shlex
import uuid

import trio

from bmdb import Backoff, Process, Queries, Work
from bmdb.model import DecommissionTarget
from common.text import printable
from shepherd.control_loop import ProcessingFailed
from shepherd.providers import Provider, ProviderError
from shepherd.ssh import SSHClient, SSHError

logger = logging.getLogger("shepherd.decommissioner")

#: A failed step is tried again after 1 minute, growing by x2 up to 1 hour.
DEFAULT_BACKOFF = Backoff(initial=60, maximum=3600, exponent=2)

#: Bound on the SSH session of a wipe (connect, run, stop the node).
DEFAULT_WIPE_TIMEOUT = 120.0


class Decommissioner:
    """Decommissions machines; a :class:`shepherd.control_loop.Processor`."""

    component = "shepherd-decommissioner"
    process = Process.SHEPHERD_DECOMMISSION

    def __init__(
        self,
        provider: Provider,
        ssh: SSHClient,
        *,
        agent_target_path: str,
        wipe_timeout: float = DEFAULT_WIPE_TIMEOUT,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        if not wipe_timeout > 0:
            raise ValueError("the wipe timeout must be positive")
        self.provider = provider
        self.ssh = ssh
        self.agent_target_path = agent_target_path
        self.wipe_timeout = wipe_timeout
        self.backoff = backoff

    async def source(self, q: Queries) -> DecommissionTarget | None:
        targets = await q.machines_for_decommission(1)
        return targets[0] if targets else None

    def machine_id(self, task: DecommissionTarget) -> uuid.UUID:
        return task.machine_id

    async def handle(self, work: Work, task: DecommissionTarget) -> None:
        mid = task.machine_id
        provided = task.provided
        if provided is None:
            raise ProcessingFailed("machine has no provider tag: nothing to wipe or release")
        if provided.provider != self.provider.type:
            raise ProcessingFailed(
                f"machine is provided by {provided.provider}, "
                f"this decommissioner serves {self.provider.type}"
            )
        if not task.wiped:
            report = await self._wipe(mid, provided.provider_id, task.host_key)

            async def wiped(q: Queries) -> None:
                await q.record_wipe(mid, report)

            await work.transact(wiped)
            logger.info("machine %s: wiped: %s", mid, report)
        if not task.released:
            try:
                detail = await self.provider.release(provided.provider_id)
            except ProviderError as exc:
                raise ProcessingFailed(f"provider did not release the machine: {exc}") from exc

            async def released(q: Queries) -> None:
                await q.record_release(mid, printable(detail))

            await work.transact(released)
            logger.info("machine %s: released: %s", mid, detail)

        async def tombstone(q: Queries) -> None:
            await q.tombstone(mid)

        await work.finish(tombstone)
        logger.info("machine %s: decommissioned", mid)

    async def _wipe(self, mid: uuid.UUID, provider_id: str, host_key: bytes | None) -> str:
        """Run ``agent --wipe`` on the machine; its report as one line."""
        if host_key is None:
            raise ProcessingFailed(
                "no pinned SSH host key: a wipe dials only a machine that proved its key "
                "at a takeover"
            )
        try:
            machine = await self.provider.get_machine(provider_id)
        except ProviderError as exc:
            raise ProcessingFailed(f"failed to fetch machine from provider: {exc}") from exc
        if not machine.address:
            raise ProcessingFailed(f"machine has no address (provider id {provider_id!r})")
        command = f"{shlex.quote(self.agent_target_path)} --wipe"
        result = None
        with trio.move_on_after(self.wipe_timeout):
            try:
                async with self.ssh.connect(
                    machine.address, machine.port, known_host_key=host_key
                ) as conn:
                    result = await conn.run(command)
            except SSHError as exc:
                raise ProcessingFailed(f"wipe: {exc}") from exc
        if result is None:
            raise ProcessingFailed(f"wipe timed out after {self.wipe_timeout:g}s")
        stdout = result.stdout.decode("utf-8", errors="replace").strip()
        try:
            report = json.loads(stdout.splitlines()[-1]) if stdout else None
        except ValueError:
            report = None
        if not isinstance(report, dict) or not all(
            isinstance(report.get(k), list) for k in ("wiped", "stopped", "errors")
        ):
            stderr = result.stderr.decode("utf-8", errors="replace").strip()
            raise ProcessingFailed(
                f"wipe: the agent gave no report (exit status {result.exit_status}): "
                f"{printable(stderr or stdout)[:500]}"
            )
        if report["errors"] or result.exit_status != 0:
            raise ProcessingFailed(
                f"wipe failed: {printable('; '.join(map(str, report['errors'])))}"
            )
        return printable(
            f"stopped {len(report['stopped'])} process(es), removed {len(report['wiped'])} "
            f"path(s): {', '.join(map(str, report['wiped']))}"
        )
